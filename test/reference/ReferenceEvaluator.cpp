//===- ReferenceEvaluator.cpp - Op-by-op evaluation of loom IR ------------===//

#include "test/reference/ReferenceEvaluator.h"
#include "dialects/loom/IR/LoomOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"

#include <cmath>
#include <stdexcept>

using namespace mlir;
using namespace mlir::loom;

namespace loom::reference {
namespace {

int64_t product(const std::vector<int64_t> &s) {
  int64_t n = 1;
  for (int64_t d : s)
    n *= d;
  return n;
}

std::vector<int64_t> shapeOf(Value v) {
  auto t = cast<RankedTensorType>(v.getType());
  return {t.getShape().begin(), t.getShape().end()};
}

/// Multi-index <-> linear index in row-major order.
std::vector<int64_t> unravel(int64_t i, const std::vector<int64_t> &shape) {
  std::vector<int64_t> idx(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = i % shape[d];
    i /= shape[d];
  }
  return idx;
}
int64_t ravel(const std::vector<int64_t> &idx, const std::vector<int64_t> &shape) {
  int64_t i = 0;
  for (size_t d = 0; d < shape.size(); ++d)
    i = i * shape[d] + idx[d];
  return i;
}

/// Reads `t` at an index of a (broadcast) result shape.
double atBroadcast(const Tensor &t, const std::vector<int64_t> &outIdx) {
  std::vector<int64_t> idx(t.shape.size());
  size_t off = outIdx.size() - t.shape.size();
  for (size_t d = 0; d < t.shape.size(); ++d)
    idx[d] = t.shape[d] == 1 ? 0 : outIdx[off + d];
  return t.data[ravel(idx, t.shape)];
}

int64_t normAxis(int64_t a, size_t rank) { return a < 0 ? a + static_cast<int64_t>(rank) : a; }

class Evaluator {
public:
  Evaluator(ModuleOp module, const ParamLookup &params) : module(module), params(params) {}

  std::vector<Tensor> call(Region &body, const std::vector<Tensor> &args, const std::string &prefix) {
    std::map<void *, Tensor> env;
    Block &block = body.front();
    for (auto [arg, t] : llvm::zip(block.getArguments(), args))
      env[arg.getAsOpaquePointer()] = t;
    auto get = [&](Value v) -> const Tensor & { return env.at(v.getAsOpaquePointer()); };
    for (Operation &op : block) {
      if (isa<ParamOp>(op))
        continue;
      if (isa<func::ReturnOp, YieldOp>(op)) {
        std::vector<Tensor> out;
        for (Value v : op.getOperands())
          out.push_back(get(v));
        return out;
      }
      std::vector<Tensor> results = eval(op, get, prefix);
      for (auto [r, t] : llvm::zip(op.getResults(), results))
        env[r.getAsOpaquePointer()] = std::move(t);
    }
    throw std::runtime_error("region without terminator");
  }

private:
  template <typename Get>
  std::vector<Tensor> eval(Operation &op, Get &get, const std::string &prefix) {
    auto in = [&](unsigned i) -> const Tensor & { return get(op.getOperand(i)); };
    Tensor out;
    if (op.getNumResults() == 1) {
      out.shape = shapeOf(op.getResult(0));
      out.data.assign(product(out.shape), 0.0);
    }
    auto unary = [&](auto f) {
      for (size_t i = 0; i < out.data.size(); ++i)
        out.data[i] = f(in(0).data[i]);
      return std::vector<Tensor>{out};
    };
    auto binary = [&](auto f) {
      for (int64_t i = 0; i < product(out.shape); ++i) {
        auto idx = unravel(i, out.shape);
        out.data[i] = f(atBroadcast(in(0), idx), atBroadcast(in(1), idx));
      }
      return std::vector<Tensor>{out};
    };

    if (auto g = dyn_cast<GetOp>(op)) {
      ParamOp p = g.lookupParam();
      bool perLayer = isa<BlockOp>(p->getParentOp());
      return {params((perLayer ? prefix : "") + p.getSymName().str())};
    }
    if (auto r = dyn_cast<RepeatOp>(op)) {
      BlockOp block = r.lookupBlock();
      std::vector<Tensor> carried;
      for (Value v : r.getInputs())
        carried.push_back(get(v));
      for (int64_t l = 0; l < r.getCount(); ++l)
        carried = call(block.getBody(), carried,
                       prefix + block.getSymName().str() + "." + std::to_string(l) + ".");
      return carried;
    }
    if (auto c = dyn_cast<func::CallOp>(op)) {
      auto callee = module.lookupSymbol<func::FuncOp>(c.getCallee());
      std::vector<Tensor> args;
      for (Value v : c.getOperands())
        args.push_back(get(v));
      return call(callee.getBody(), args, prefix);
    }
    if (isa<AddOp>(op)) return binary([](double a, double b) { return a + b; });
    if (isa<SubOp>(op)) return binary([](double a, double b) { return a - b; });
    if (isa<MulOp>(op)) return binary([](double a, double b) { return a * b; });
    if (isa<DivOp>(op)) return binary([](double a, double b) { return a / b; });
    if (auto g = dyn_cast<GeluOp>(op)) {
      if (g.getApproximate())
        return unary([](double x) {
          return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
        });
      return unary([](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); });
    }
    if (isa<ReluOp>(op)) return unary([](double x) { return std::max(x, 0.0); });
    if (isa<SiluOp>(op)) return unary([](double x) { return x / (1 + std::exp(-x)); });
    if (isa<ExpOp>(op)) return unary([](double x) { return std::exp(x); });
    if (isa<TanhOp>(op)) return unary([](double x) { return std::tanh(x); });
    if (isa<RsqrtOp>(op)) return unary([](double x) { return 1 / std::sqrt(x); });
    if (isa<NegOp>(op)) return unary([](double x) { return -x; });
    if (auto s = dyn_cast<ScaleOp>(op)) {
      double f = s.getFactor().convertToDouble();
      return unary([f](double x) { return x * f; });
    }
    if (auto m = dyn_cast<MatmulOp>(op)) {
      // Broadcast both operands to the result's batch, as plain [batch][rows][cols].
      size_t ro = out.shape.size();
      int64_t M = out.shape[ro - 2], N = out.shape[ro - 1];
      int64_t K = m.getTransposeA() ? in(0).shape[in(0).shape.size() - 2] : in(0).shape.back();
      int64_t batch = product(out.shape) / (M * N);
      auto expand = [&](const Tensor &t, int64_t rows, int64_t cols) {
        std::vector<int64_t> full(out.shape.begin(), out.shape.end() - 2);
        full.push_back(rows);
        full.push_back(cols);
        if (t.shape == full)
          return t.data;
        std::vector<double> data(product(full));
        if (product(t.shape) == rows * cols) { // one matrix shared by every batch
          for (int64_t i = 0; i < product(full); ++i)
            data[i] = t.data[i % (rows * cols)];
          return data;
        }
        for (int64_t i = 0; i < product(full); ++i)
          data[i] = atBroadcast(t, unravel(i, full));
        return data;
      };
      const Tensor &ta = in(0), &tb = in(1);
      std::vector<double> A = m.getTransposeA() ? expand(ta, K, M) : expand(ta, M, K);
      std::vector<double> B = m.getTransposeB() ? expand(tb, N, K) : expand(tb, K, N);
      // Bring both to [batch][M][K] and [batch][K][N], then plain i-k-j loops
      // accumulating in double.
      auto transposeEach = [&](const std::vector<double> &x, int64_t r, int64_t c) {
        std::vector<double> t(x.size());
        for (int64_t bi = 0; bi < batch; ++bi)
          for (int64_t i = 0; i < r; ++i)
            for (int64_t j = 0; j < c; ++j)
              t[(bi * c + j) * r + i] = x[(bi * r + i) * c + j];
        return t;
      };
      if (m.getTransposeA())
        A = transposeEach(A, K, M);
      if (m.getTransposeB())
        B = transposeEach(B, N, K);
      std::vector<double> row(N);
      for (int64_t bi = 0; bi < batch; ++bi)
        for (int64_t i = 0; i < M; ++i) {
          std::fill(row.begin(), row.end(), 0.0);
          for (int64_t k = 0; k < K; ++k) {
            double av = A[(bi * M + i) * K + k];
            const double *brow = B.data() + (bi * K + k) * N;
            for (int64_t j = 0; j < N; ++j)
              row[j] += av * brow[j];
          }
          std::copy(row.begin(), row.end(), out.data.begin() + (bi * M + i) * N);
        }
      return {out};
    }
    if (isa<ReduceSumOp, ReduceMaxOp, ReduceMeanOp>(op)) {
      const Tensor &x = in(0);
      auto axes = op.getAttrOfType<DenseI64ArrayAttr>("axes").asArrayRef();
      bool keep = op.hasAttr("keepdim");
      std::vector<bool> red(x.shape.size(), false);
      for (int64_t a : axes)
        red[normAxis(a, x.shape.size())] = true;
      bool isMax = isa<ReduceMaxOp>(op);
      std::vector<int64_t> count(out.data.size(), 0);
      if (isMax)
        std::fill(out.data.begin(), out.data.end(), -INFINITY);
      for (int64_t i = 0; i < product(x.shape); ++i) {
        auto idx = unravel(i, x.shape);
        std::vector<int64_t> o;
        for (size_t d = 0; d < idx.size(); ++d)
          if (!red[d])
            o.push_back(idx[d]);
          else if (keep)
            o.push_back(0);
        int64_t oi = ravel(o, out.shape);
        out.data[oi] = isMax ? std::max(out.data[oi], x.data[i]) : out.data[oi] + x.data[i];
        count[oi]++;
      }
      if (isa<ReduceMeanOp>(op))
        for (size_t i = 0; i < out.data.size(); ++i)
          out.data[i] /= count[i];
      return {out};
    }
    if (auto s = dyn_cast<SoftmaxOp>(op)) {
      const Tensor &x = in(0);
      int64_t axis = normAxis(s.getAxis(), x.shape.size());
      for (int64_t i = 0; i < product(x.shape); ++i) {
        auto idx = unravel(i, x.shape);
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < x.shape[axis]; ++j) {
          idx[axis] = j;
          mx = std::max(mx, x.data[ravel(idx, x.shape)]);
        }
        for (int64_t j = 0; j < x.shape[axis]; ++j) {
          idx[axis] = j;
          sum += std::exp(x.data[ravel(idx, x.shape)] - mx);
        }
        out.data[i] = std::exp(x.data[i] - mx) / sum;
      }
      return {out};
    }
    if (isa<LayerNormOp, RMSNormOp>(op)) {
      bool rms = isa<RMSNormOp>(op);
      double eps = rms ? cast<RMSNormOp>(op).getEps().convertToDouble()
                       : cast<LayerNormOp>(op).getEps().convertToDouble();
      const Tensor &x = in(0), &g = in(1);
      int64_t h = x.shape.back();
      for (int64_t r = 0; r < product(x.shape) / h; ++r) {
        double mean = 0, var = 0;
        for (int64_t j = 0; j < h; ++j)
          mean += x.data[r * h + j] / h;
        if (rms)
          mean = 0;
        for (int64_t j = 0; j < h; ++j)
          var += (x.data[r * h + j] - mean) * (x.data[r * h + j] - mean) / h;
        for (int64_t j = 0; j < h; ++j)
          out.data[r * h + j] = (x.data[r * h + j] - mean) / std::sqrt(var + eps) * g.data[j] +
                                (rms ? 0.0 : in(2).data[j]);
      }
      return {out};
    }
    if (auto bn = dyn_cast<BatchNormOp>(op)) {
      const Tensor &x = in(0), &g = in(1), &b = in(2);
      int64_t C = x.shape[1];
      std::vector<double> mean(C, 0), var(C, 0), n(C, 0);
      for (int64_t i = 0; i < product(x.shape); ++i) {
        int64_t c = unravel(i, x.shape)[1];
        mean[c] += x.data[i];
        n[c] += 1;
      }
      for (int64_t c = 0; c < C; ++c)
        mean[c] /= n[c];
      for (int64_t i = 0; i < product(x.shape); ++i) {
        int64_t c = unravel(i, x.shape)[1];
        var[c] += (x.data[i] - mean[c]) * (x.data[i] - mean[c]) / n[c];
      }
      double eps = bn.getEps().convertToDouble();
      for (int64_t i = 0; i < product(x.shape); ++i) {
        int64_t c = unravel(i, x.shape)[1];
        out.data[i] = (x.data[i] - mean[c]) / std::sqrt(var[c] + eps) * g.data[c] + b.data[c];
      }
      return {out};
    }
    if (isa<EmbeddingOp>(op)) {
      const Tensor &table = in(0), &ids = in(1);
      int64_t h = table.shape[1];
      for (size_t i = 0; i < ids.data.size(); ++i)
        for (int64_t j = 0; j < h; ++j)
          out.data[i * h + j] = table.data[static_cast<int64_t>(ids.data[i]) * h + j];
      return {out};
    }
    if (auto r = dyn_cast<RotaryOp>(op)) {
      const Tensor &x = in(0);
      int64_t S = x.shape[1], W = x.shape[2], H = r.getNumHeads(), D = W / H;
      double theta = r.getTheta().convertToDouble();
      for (int64_t i = 0; i < product(x.shape); ++i) {
        auto idx = unravel(i, x.shape);
        int64_t pos = idx[1], within = idx[2] % D, pair = within / 2;
        double angle = pos / std::pow(theta, 2.0 * pair / D);
        int64_t base = i - within % 2;
        double x0 = x.data[base], x1 = x.data[base + 1];
        out.data[i] = within % 2 == 0 ? x0 * std::cos(angle) - x1 * std::sin(angle)
                                      : x0 * std::sin(angle) + x1 * std::cos(angle);
      }
      (void)S;
      return {out};
    }
    if (auto a = dyn_cast<AttentionOp>(op)) {
      const Tensor &q = in(0), &k = in(1), &v = in(2);
      int64_t B = q.shape[0], S = q.shape[1], T = k.shape[1], H = a.getNumHeads();
      int64_t KV = a.getKvHeads(), D = q.shape[2] / H;
      double scale = a.getScale() ? a.getScale()->convertToDouble() : 1 / std::sqrt(double(D));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t s = 0; s < S; ++s) {
            int64_t kh = h / (H / KV);
            std::vector<double> score(T, -INFINITY);
            double mx = -INFINITY;
            for (int64_t t = 0; t < T; ++t) {
              if (a.getCausal() && t > s + (T - S))
                continue;
              double dot = 0;
              for (int64_t d = 0; d < D; ++d)
                dot += q.data[(b * S + s) * H * D + h * D + d] * k.data[(b * T + t) * KV * D + kh * D + d];
              score[t] = dot * scale;
              mx = std::max(mx, score[t]);
            }
            double sum = 0;
            for (int64_t t = 0; t < T; ++t)
              sum += std::exp(score[t] - mx);
            for (int64_t d = 0; d < D; ++d) {
              double acc = 0;
              for (int64_t t = 0; t < T; ++t)
                acc += std::exp(score[t] - mx) / sum * v.data[(b * T + t) * KV * D + kh * D + d];
              out.data[(b * S + s) * H * D + h * D + d] = acc;
            }
          }
      return {out};
    }
    if (isa<CrossEntropyOp>(op)) {
      const Tensor &l = in(0), &t = in(1);
      int64_t V = l.shape.back(), rows = product(t.shape);
      double total = 0;
      for (int64_t r = 0; r < rows; ++r) {
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < V; ++j)
          mx = std::max(mx, l.data[r * V + j]);
        for (int64_t j = 0; j < V; ++j)
          sum += std::exp(l.data[r * V + j] - mx);
        total += std::log(sum) + mx - l.data[r * V + static_cast<int64_t>(t.data[r])];
      }
      out.data[0] = total / rows;
      return {out};
    }
    if (isa<ReshapeOp, CastOp>(op)) {
      out.data = in(0).data;
      return {out};
    }
    if (isa<BroadcastOp>(op)) {
      for (int64_t i = 0; i < product(out.shape); ++i)
        out.data[i] = atBroadcast(in(0), unravel(i, out.shape));
      return {out};
    }
    if (auto t = dyn_cast<TransposeOp>(op)) {
      auto perm = t.getPermutation();
      for (int64_t i = 0; i < product(out.shape); ++i) {
        auto idx = unravel(i, out.shape);
        std::vector<int64_t> src(idx.size());
        for (size_t d = 0; d < perm.size(); ++d)
          src[perm[d]] = idx[d];
        out.data[i] = in(0).data[ravel(src, in(0).shape)];
      }
      return {out};
    }
    if (auto s = dyn_cast<SliceOp>(op)) {
      int64_t axis = normAxis(s.getAxis(), out.shape.size());
      for (int64_t i = 0; i < product(out.shape); ++i) {
        auto idx = unravel(i, out.shape);
        idx[axis] += s.getStart();
        out.data[i] = in(0).data[ravel(idx, in(0).shape)];
      }
      return {out};
    }
    if (auto c = dyn_cast<ConcatOp>(op)) {
      int64_t axis = normAxis(c.getAxis(), out.shape.size());
      for (int64_t i = 0; i < product(out.shape); ++i) {
        auto idx = unravel(i, out.shape);
        for (unsigned k = 0; k < op.getNumOperands(); ++k) {
          if (idx[axis] < in(k).shape[axis]) {
            out.data[i] = in(k).data[ravel(idx, in(k).shape)];
            break;
          }
          idx[axis] -= in(k).shape[axis];
        }
      }
      return {out};
    }
    if (auto c = dyn_cast<Conv2DOp>(op)) {
      const Tensor &x = in(0), &w = in(1);
      int64_t stride = c.getStride(), pad = c.getPadding(), groups = c.getGroups();
      int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
      int64_t O = w.shape[0], Cg = w.shape[1], KH = w.shape[2], KW = w.shape[3], Og = O / groups;
      int64_t Ho = out.shape[2], Wo = out.shape[3];
      for (int64_t n = 0; n < N; ++n)
        for (int64_t oc = 0; oc < O; ++oc)
          for (int64_t oh = 0; oh < Ho; ++oh)
            for (int64_t ow = 0; ow < Wo; ++ow) {
              double acc = 0;
              for (int64_t ci = 0; ci < Cg; ++ci)
                for (int64_t kh = 0; kh < KH; ++kh)
                  for (int64_t kw = 0; kw < KW; ++kw) {
                    int64_t ih = oh * stride - pad + kh, iw = ow * stride - pad + kw;
                    if (ih < 0 || iw < 0 || ih >= H || iw >= W)
                      continue;
                    int64_t cin = (oc / Og) * Cg + ci;
                    acc += x.data[((n * C + cin) * H + ih) * W + iw] *
                           w.data[((oc * Cg + ci) * KH + kh) * KW + kw];
                  }
              out.data[((n * O + oc) * Ho + oh) * Wo + ow] = acc;
            }
      return {out};
    }
    if (isa<MaxPool2DOp, AvgPool2DOp>(op)) {
      bool isMax = isa<MaxPool2DOp>(op);
      int64_t k = op.getAttrOfType<IntegerAttr>("kernel").getInt();
      auto strideAttr = op.getAttrOfType<IntegerAttr>("stride");
      auto padAttr = op.getAttrOfType<IntegerAttr>("padding");
      int64_t stride = strideAttr ? strideAttr.getInt() : 1, pad = padAttr ? padAttr.getInt() : 0;
      const Tensor &x = in(0);
      for (int64_t i = 0; i < product(out.shape); ++i) {
        auto o = unravel(i, out.shape);
        double acc = isMax ? -INFINITY : 0;
        for (int64_t kh = 0; kh < k; ++kh)
          for (int64_t kw = 0; kw < k; ++kw) {
            int64_t ih = o[2] * stride - pad + kh, iw = o[3] * stride - pad + kw;
            if (ih < 0 || iw < 0 || ih >= x.shape[2] || iw >= x.shape[3])
              continue;
            double v = x.data[ravel({o[0], o[1], ih, iw}, x.shape)];
            acc = isMax ? std::max(acc, v) : acc + v;
          }
        out.data[i] = isMax ? acc : acc / double(k * k);
      }
      return {out};
    }
    throw std::runtime_error("the reference evaluator does not know '" +
                             op.getName().getStringRef().str() + "'");
  }

  ModuleOp module;
  const ParamLookup &params;
};

} // namespace

bool evaluateForward(ModuleOp module, const std::vector<Tensor> &inputs, const ParamLookup &params,
                     std::vector<Tensor> &outputs, std::string &error) {
  auto forward = module.lookupSymbol<func::FuncOp>("forward");
  if (!forward) {
    error = "no @forward";
    return false;
  }
  try {
    Evaluator e(module, params);
    outputs = e.call(forward.getBody(), inputs, "");
    return true;
  } catch (const std::exception &ex) {
    error = ex.what();
    return false;
  }
}

} // namespace loom::reference
