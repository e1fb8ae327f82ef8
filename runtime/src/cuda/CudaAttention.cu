//===- CudaAttention.cu - Attention: cuDNN, flash kernels, or GEMMs --------===//
//
// bf16 attention runs cuDNN's fused SDPA where it has an engine
// (LOOM_CUDA_ATTENTION) and our flash kernels (FlashAttention.cu) otherwise;
// q|k|v may be read in place as columns of one packed tensor. The backward
// reuses the forward's output and row statistics while nothing has written
// over them. f32 attention: batched GEMMs around a masked softmax.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cuda/CudaBackendImpl.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace loom::rt::cuda {
namespace {

/// Softmax over rows of `len` in place, with an optional causal mask: row r
/// of a [S, T] score matrix keeps columns t <= (r % S) + T - S.
__global__ void softmaxRowsKernel(float *p, int64_t rows, int64_t len, int64_t s, bool causal) {
  __shared__ float shared[32];
  int64_t row = blockIdx.x;
  float *pr = p + row * len;
  int64_t last = causal ? min(len, (row % s) + 1 + (len - s)) : len;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < last; j += blockDim.x)
    mx = fmaxf(mx, pr[j]);
  mx = blockMax(mx, shared);
  float sum = 0;
  for (int64_t j = threadIdx.x; j < last; j += blockDim.x)
    sum += expf(pr[j] - mx);
  sum = blockSum(sum, shared);
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x)
    pr[j] = j < last ? expf(pr[j] - mx) / sum : 0.0f;
}

/// dS = P * (dP - sum(P * dP)) * scale, in place over dP.
__global__ void softmaxGradRowsKernel(const float *p, float *dp, int64_t len, float scale) {
  __shared__ float shared[32];
  int64_t row = blockIdx.x;
  const float *pr = p + row * len;
  float *dr = dp + row * len;
  float dot = 0;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x)
    dot += pr[j] * dr[j];
  dot = blockSum(dot, shared);
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x)
    dr[j] = pr[j] * (dr[j] - dot) * scale;
}

} // namespace

bool CudaBackendImpl::outputIntact(const AttentionSave &save, const std::pair<std::string, size_t> &use) const {
  std::vector<const Instruction *> between;
  auto range = [&](const std::string &name, size_t from, size_t to) {
    const std::vector<Instruction> &list = instructions.at(name);
    for (size_t i = from; i < std::min(to, list.size()); ++i)
      between.push_back(&list[i]);
  };
  if (save.at.first == use.first && save.at.second < use.second)
    range(use.first, save.at.second + 1, use.second);
  else if (save.at.first == "forward" && use.first == "backward")
    range("forward", save.at.second + 1, SIZE_MAX), range("backward", 0, use.second);
  else
    return false;
  for (const Instruction *ins : between)
    for (int64_t id : ins->out)
      if (overlaps(id, save.out))
        return false;
  return true;
}

/// cuDNN's fused attention for `p` where LOOM_CUDA_ATTENTION allows it
/// ("auto", the default: where cuDNN has an engine; "cudnn": required;
/// "loom": never) and it builds; null means our flash kernels.
std::shared_ptr<cudnn::Attention> CudaBackendImpl::cudnnAttention(const flash::Params &p, bool backward) {
  static const std::string mode = [] {
    const char *e = std::getenv("LOOM_CUDA_ATTENTION");
    return std::string(e ? e : "auto");
  }();
  if (mode != "auto" && mode != "cudnn" && mode != "loom")
    fail(LOOM_INVALID_ARGUMENT, "LOOM_CUDA_ATTENTION is '", mode, "'; use auto, cudnn or loom");
  if (mode == "loom")
    return nullptr;
  std::string why;
  std::shared_ptr<cudnn::Attention> a = cudnn::build(p, backward, why, deterministic());
  if (!a && mode == "cudnn")
    fail(LOOM_UNSUPPORTED, where, ": LOOM_CUDA_ATTENTION=cudnn, but ", why);
  if (!a && backward && deterministic()) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      std::fprintf(stderr, "loom: LOOM_DETERMINISTIC=1, but %s: our attention backward sums dQ with atomics, so "
                           "its results may differ between runs in the last bits\n", why.c_str());
    });
  }
  if (a)
    reserve(a->workspaceBytes());
  return a;
}

/// The attention forward (cuDNN's or our flash kernel), keeping the rows'
/// statistics for the backward (see AttentionSave).
Launch CudaBackendImpl::flashForward(const flash::Params &p, int64_t out, AttentionKey key) {
  std::string what = where;
  char *po = ptr(buf(out));
  auto save = std::make_shared<AttentionSave>();
  save->lse = deviceArray(std::vector<float>(size_t(p.batch * p.heads * p.s)));
  save->out = out;
  save->at = building;
  std::shared_ptr<cudnn::Attention> fused = cudnnAttention(p, /*backward=*/false);
  save->cudnnStats = fused != nullptr;
  attentionSaves[key] = save;
  buildReplayed = [save] { save->fresh = true; };
  return [=](cudaStream_t st) {
    if (fused) {
      if (std::string e = fused->forward(po, save->lse, workspace, st); !e.empty())
        fail(LOOM_INTERNAL, what, ": cuDNN attention forward failed: ", e, " (LOOM_CUDA_ATTENTION=loom avoids cuDNN)");
    } else if (cudaError_t e = flash::forward(p, po, save->lse, st); e != cudaSuccess) {
      fail(LOOM_INTERNAL, what, ": flash attention forward failed: ", cudaGetErrorString(e));
    }
    save->fresh = true;
  };
}

/// Its backward; `clear` (bytes) is zeroed first where the gradients do not
/// cover their tensor. cuDNN's backward runs where the forward was cuDNN's
/// and its output and statistics are still there; our kernels otherwise
/// (recomputing O and the statistics when they are gone).
Launch CudaBackendImpl::flashBackward(const flash::Params &p, char *pdo, char *gq, char *gk, char *gv,
                                      AttentionKey key, char *clear, int64_t clearBytes) {
  std::string what = where;
  reserve(flash::backwardWorkspace(p));
  // Built whether or not the forward (perhaps prepared later) is cuDNN's;
  // used only where it was.
  std::shared_ptr<cudnn::Attention> fused = cudnnAttention(p, /*backward=*/true);
  // The forward's output and statistics are used when they are still there
  // (decided at the first launch, once every program is prepared);
  // otherwise the backward recomputes them.
  struct Reuse {
    bool decided = false;
    std::shared_ptr<AttentionSave> save;
    bool usedSave = false; // at the last launch (a captured graph's, when one replays)
  };
  auto reuse = std::make_shared<Reuse>();
  auto use = building;
  buildReplayable = [reuse] { return reuse->usedSave == (reuse->save && reuse->save->fresh); };
  buildReplayed = [reuse] {
    if (reuse->save)
      reuse->save->fresh = false;
  };
  return [=](cudaStream_t st) {
    if (!reuse->decided) {
      reuse->decided = true;
      auto it = attentionSaves.find(key);
      if (it != attentionSaves.end() && outputIntact(*it->second, use))
        reuse->save = it->second;
    }
    AttentionSave *save = reuse->save.get();
    bool saved = save && save->fresh;
    reuse->usedSave = saved;
    const void *o = saved ? ptr(buf(save->out)) : nullptr;
    if (clear)
      LOOM_CUDA_CHECK(cudaMemsetAsync(clear, 0, clearBytes, st));
    if (saved && save->cudnnStats && fused) {
      if (std::string e = fused->backward(o, save->lse, pdo, gq, gk, gv, workspace, st); !e.empty())
        fail(LOOM_INTERNAL, what, ": cuDNN attention backward failed: ", e, " (LOOM_CUDA_ATTENTION=loom avoids cuDNN)");
    } else {
      // Our kernels read our statistics only; cuDNN's are recomputed.
      bool ours = saved && !save->cudnnStats;
      if (cudaError_t e = flash::backward(p, pdo, gq, gk, gv, workspace, st, ours ? o : nullptr,
                                          ours ? save->lse : nullptr);
          e != cudaSuccess)
        fail(LOOM_INTERNAL, what, ": flash attention backward failed: ", cudaGetErrorString(e));
    }
    if (save)
      save->fresh = false;
  };
}

/// Attention over q|k|v packed as columns of one bf16 tensor x [B, S, W]
/// (attrs "packed": their starts), the gradient written as dq|dk|dv into dx:
/// the flash kernels read and write the columns in place (row stride W).
Launch CudaBackendImpl::buildPackedAttention(const Instruction &ins, bool grad) {
  if (ins.in.size() != (grad ? 2u : 1u) || ins.out.size() != 1)
    fail(LOOM_INVALID_BUNDLE, where, ": packed attention takes ", grad ? "x and dO" : "x", " and writes one tensor");
  const Buffer &x = buf(ins.in[0]), &dense = grad ? buf(ins.in[1]) : buf(ins.out[0]);
  for (const Buffer *b : {&x, &dense, &buf(ins.out[0])})
    if (!isBf16(*b))
      fail(LOOM_UNSUPPORTED, where, ": packed q|k|v attention runs on bf16 tensors on the GPU ('", b->name, "' is ",
           dtypeName(b->dtype), ")");
  int64_t heads = static_cast<int64_t>(num(ins, "num_heads", 1));
  int64_t kv = static_cast<int64_t>(num(ins, "num_kv_heads", double(heads)));
  int64_t B = x.shape[0], S = x.shape[1], W = x.shape[2], D = dense.shape[2] / heads;
  std::vector<int64_t> starts = ins.attrs.at("packed").get<std::vector<int64_t>>();
  if (!flash::supported(D))
    fail(LOOM_UNSUPPORTED, where, ": bf16 attention has kernels for head dimensions 16, 32, 64 and 128, not ", D,
         "; compile with --precision f32 for this model");
  if (W % 8 != 0 || starts.size() != 3 || std::any_of(starts.begin(), starts.end(), [](int64_t v) { return v % 8; }))
    fail(LOOM_UNSUPPORTED, where, ": packed attention needs a width and starts that are multiples of 8 (16-byte rows)");
  flash::Params p;
  char *px = ptr(x);
  p.q = px + 2 * starts[0], p.k = px + 2 * starts[1], p.v = px + 2 * starts[2];
  p.batch = B, p.s = S, p.t = S, p.heads = heads, p.kvHeads = kv, p.headDim = D, p.causal = flag(ins, "causal");
  p.scale = static_cast<float>(num(ins, "scale", 1.0 / std::sqrt(double(D))));
  p.ldq = p.ldk = W;
  auto key = std::make_tuple(ins.in[0], int64_t(-1), int64_t(-1));
  if (!grad)
    return flashForward(p, ins.out[0], key);
  p.lddq = p.lddk = W;
  char *dx = ptr(buf(ins.out[0]));
  // dq|dk|dv tile x's columns in the compiler's form; otherwise zero the rest first.
  std::vector<std::pair<int64_t, int64_t>> parts = {{starts[0], heads * D}, {starts[1], kv * D}, {starts[2], kv * D}};
  std::sort(parts.begin(), parts.end());
  bool tiles = parts[0].first == 0 && parts[1].first == parts[0].second && parts[2].first == parts[1].first + parts[1].second &&
               parts[2].first + parts[2].second == W;
  return flashBackward(p, ptr(dense), dx + 2 * starts[0], dx + 2 * starts[1], dx + 2 * starts[2], key,
                       tiles ? nullptr : dx, buf(ins.out[0]).bytes);
}

Launch CudaBackendImpl::buildAttention(const Instruction &ins, bool grad) {
  if (ins.attrs.contains("packed"))
    return buildPackedAttention(ins, grad);
  const Buffer &q = buf(ins.in[0]), &k = buf(ins.in[1]);
  int64_t heads = static_cast<int64_t>(num(ins, "num_heads", 1));
  int64_t kv = static_cast<int64_t>(num(ins, "num_kv_heads", double(heads)));
  int64_t B = q.shape[0], S = q.shape[1], T = k.shape[1], D = q.shape[2] / heads, group = heads / kv;
  bool causal = flag(ins, "causal");
  float scale = static_cast<float>(num(ins, "scale", 1.0 / std::sqrt(double(D))));
  int64_t ldq = heads * D, ldk = kv * D;
  if (isBf16(q)) { // fused flash attention on bf16 tensor cores
    for (size_t i = 0; i < ins.in.size(); ++i)
      if (!isBf16(buf(ins.in[i])))
        fail(LOOM_UNSUPPORTED, where, ": mixes bf16 and ", dtypeName(buf(ins.in[i]).dtype), " operands");
    for (int64_t id : ins.out)
      if (!isBf16(buf(id)))
        fail(LOOM_UNSUPPORTED, where, ": bf16 attention with a ", dtypeName(buf(id).dtype), " result");
    if (!flash::supported(D))
      fail(LOOM_UNSUPPORTED, where, ": bf16 attention has kernels for head dimensions 16, 32, 64 and 128, not ", D,
           "; compile with --precision f32 for this model");
    flash::Params p;
    p.q = ptr(q), p.k = ptr(k), p.v = ptr(buf(ins.in[2]));
    p.batch = B, p.s = S, p.t = T, p.heads = heads, p.kvHeads = kv, p.headDim = D, p.causal = causal, p.scale = scale;
    auto key = std::make_tuple(ins.in[0], ins.in[1], ins.in[2]);
    if (!grad)
      return flashForward(p, ins.out[0], key);
    return flashBackward(p, ptr(buf(ins.in[3])), ptr(buf(ins.out[0])), ptr(buf(ins.out[1])), ptr(buf(ins.out[2])),
                         key, nullptr, 0);
  }
  buildCapturable = false; // copies per-launch pointer tables from host memory
  float *pq = f(ins.in[0]), *pk = f(ins.in[1]), *pv = f(ins.in[2]);
  size_t scoreBytes = size_t(B * heads * S * T) * sizeof(float);
  reserve(grad ? 2 * scoreBytes : scoreBytes);
  // Per (batch, head) matrix pointers, computed once; workspace pointers are
  // filled in at launch (the workspace is allocated after preparation).
  std::vector<const float *> qs, ks, vs;
  std::vector<int64_t> scoreOffsets;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      qs.push_back(pq + b * S * ldq + h * D);
      ks.push_back(pk + b * T * ldk + (h / group) * D);
      vs.push_back(pv + b * T * ldk + (h / group) * D);
      scoreOffsets.push_back((b * heads + h) * S * T);
    }
  int64_t count_ = B * heads;
  const float **dq = deviceArray(qs), **dk = deviceArray(ks), **dv = deviceArray(vs);
  float **dScores = deviceArray(std::vector<float *>(count_)), **dDp = deviceArray(std::vector<float *>(count_));
  auto fillScorePointers = [=](float *base, float **dst) {
    std::vector<float *> host(count_);
    for (int64_t i = 0; i < count_; ++i)
      host[i] = base + scoreOffsets[i];
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, host.data(), count_ * sizeof(float *), cudaMemcpyHostToDevice, stream));
  };
  if (!grad) {
    float *po = f(ins.out[0]);
    std::vector<float *> os;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < heads; ++h)
        os.push_back(po + b * S * ldq + h * D);
    float **dO = deviceArray(os);
    return [=](cudaStream_t st) {
      float *scores = reinterpret_cast<float *>(workspace);
      fillScorePointers(scores, dScores);
      gemmBatched(false, true, S, T, D, scale, dq, ldq, dk, ldk, 0.0f, dScores, T, count_);
      softmaxRowsKernel<<<int(count_ * S), kThreads, 0, st>>>(scores, count_ * S, T, S, causal);
      gemmBatched(false, false, S, D, T, 1.0f, const_cast<const float **>(dScores), T, dv, ldk, 0.0f, dO, ldq, count_);
    };
  }
  float *pdo = f(ins.in[3]), *gq = f(ins.out[0]), *gk = f(ins.out[1]), *gv = f(ins.out[2]);
  std::vector<const float *> dos;
  std::vector<float *> dqs;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      dos.push_back(pdo + b * S * ldq + h * D);
      dqs.push_back(gq + b * S * ldq + h * D);
    }
  const float **dDO = deviceArray(dos);
  float **dDQ = deviceArray(dqs);
  // dK and dV sum over the query heads of a group: one batched GEMM per group
  // member, accumulating (beta = 1) after the first.
  std::vector<const float **> groupP(group), groupDS(group), groupQ(group), groupDO(group);
  std::vector<float **> groupDK(group), groupDV(group);
  std::vector<std::vector<int64_t>> groupIndex(group);
  for (int64_t g = 0; g < group; ++g) {
    std::vector<const float *> qg, dog;
    std::vector<float *> dkg, dvg;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kh = 0; kh < kv; ++kh) {
        int64_t h = kh * group + g;
        groupIndex[g].push_back(b * heads + h);
        qg.push_back(pq + b * S * ldq + h * D);
        dog.push_back(pdo + b * S * ldq + h * D);
        dkg.push_back(gk + b * T * ldk + kh * D);
        dvg.push_back(gv + b * T * ldk + kh * D);
      }
    groupQ[g] = deviceArray(qg);
    groupDO[g] = deviceArray(dog);
    groupDK[g] = deviceArray(dkg);
    groupDV[g] = deviceArray(dvg);
    groupP[g] = const_cast<const float **>(deviceArray(std::vector<float *>(B * kv)));
    groupDS[g] = const_cast<const float **>(deviceArray(std::vector<float *>(B * kv)));
  }
  int64_t perGroup = B * kv;
  return [=](cudaStream_t st) {
    float *scores = reinterpret_cast<float *>(workspace), *dp = scores + count_ * S * T;
    fillScorePointers(scores, dScores);
    fillScorePointers(dp, dDp);
    // Recompute P, then dP = dO V^T and dS = softmax'(P) dP * scale.
    gemmBatched(false, true, S, T, D, scale, dq, ldq, dk, ldk, 0.0f, dScores, T, count_);
    softmaxRowsKernel<<<int(count_ * S), kThreads, 0, st>>>(scores, count_ * S, T, S, causal);
    gemmBatched(false, true, S, T, D, 1.0f, dDO, ldq, dv, ldk, 0.0f, dDp, T, count_);
    softmaxGradRowsKernel<<<int(count_ * S), kThreads, 0, st>>>(scores, dp, T, scale);
    // dQ = dS K.
    gemmBatched(false, false, S, D, T, 1.0f, const_cast<const float **>(dDp), T, dk, ldk, 0.0f, dDQ, ldq, count_);
    for (int64_t g = 0; g < group; ++g) {
      std::vector<const float *> ph(perGroup), dsh(perGroup);
      for (int64_t i = 0; i < perGroup; ++i) {
        ph[i] = scores + groupIndex[g][i] * S * T;
        dsh[i] = dp + groupIndex[g][i] * S * T;
      }
      LOOM_CUDA_CHECK(cudaMemcpyAsync(const_cast<const float **>(groupP[g]), ph.data(), perGroup * sizeof(float *), cudaMemcpyHostToDevice, stream));
      LOOM_CUDA_CHECK(cudaMemcpyAsync(const_cast<const float **>(groupDS[g]), dsh.data(), perGroup * sizeof(float *), cudaMemcpyHostToDevice, stream));
      float beta = g == 0 ? 0.0f : 1.0f;
      // dK += dS^T Q, dV += P^T dO.
      gemmBatched(true, false, T, D, S, 1.0f, groupDS[g], T, groupQ[g], ldq, beta, groupDK[g], ldk, perGroup);
      gemmBatched(true, false, T, D, S, 1.0f, groupP[g], T, groupDO[g], ldq, beta, groupDV[g], ldk, perGroup);
    }
  };
}

void CudaBackendImpl::addAttentionBuilders(BuilderTable &table) {
  table["attention"] = [](CudaBackendImpl &b, const Instruction &ins) { return b.buildAttention(ins, false); };
  table["attention_grad"] = [](CudaBackendImpl &b, const Instruction &ins) { return b.buildAttention(ins, true); };
}

} // namespace loom::rt::cuda
