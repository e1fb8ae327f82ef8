//===- Fusion.cpp - Fuse elementwise chains, fold epilogues, name kernels -===//
//
// The rewrites of `loomc compile --fuse`; the kernels they name are written
// in compiler/bundle/KernelGen.cpp.
//
//===----------------------------------------------------------------------===//

#include "passes/Fusion.h"
#include "passes/StepState.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>

using namespace mlir;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

const std::set<std::string> kFusable = {"add",  "sub",  "mul",  "div",  "neg",  "scale",     "exp",
                                        "tanh", "rsqrt", "relu", "silu", "gelu", "unary_grad"};

using rt::storageOf;

bool floating(const rt::Buffer &b) { return b.dtype == LOOM_F32 || b.dtype == LOOM_BF16; }

/// Chains fuse in two rounds: chains over f32 tensors before the GEMM
/// epilogues (an f32 bundle's results then equal the unfused bundle's
/// exactly, as they always have), and chains that read or write bf16 after
/// them, so that a bias, GELU or residual add a GEMM can take goes to
/// cuBLASLt's epilogue rather than into a generated kernel.
enum class Round { F32, Bf16 };

bool fusable(const rt::RankProgram &r, const rt::Instruction &ins, Round round) {
  if (!kFusable.count(ins.op) || ins.out.size() != 1 || ins.in.empty())
    return false;
  const rt::Buffer &out = r.buffers[ins.out[0]];
  if (!floating(out) || out.viewOf >= 0 || out.role != rt::BufferRole::Activation)
    return false;
  bool bf16 = out.dtype == LOOM_BF16;
  for (int64_t id : ins.in) {
    if (!floating(r.buffers[id]) || storageOf(r, id) == ins.out[0])
      return false; // in place (gradient accumulation) stays as it is
    bf16 |= r.buffers[id].dtype == LOOM_BF16;
  }
  return bf16 == (round == Round::Bf16);
}

/// Who reads each root buffer: (program, instruction index).
using Readers = std::map<int64_t, std::vector<std::pair<std::string, size_t>>>;
Readers readersOf(const rt::RankProgram &r) {
  Readers readers;
  for (const auto &[name, list] : r.programs)
    for (size_t i = 0; i < list.size(); ++i)
      for (int64_t id : list[i].in)
        readers[storageOf(r, id)].push_back({name, i});
  return readers;
}

/// A string attribute ("" when absent; instructions without attributes hold null).
std::string strAttr(const rt::Instruction &ins, const char *name) {
  if (!ins.attrs.is_object())
    return "";
  auto it = ins.attrs.find(name);
  return it != ins.attrs.end() && it->is_string() ? it->get<std::string>() : "";
}

/// Whether one of `ids` lives in root `root`'s storage.
bool anyRoot(const rt::RankProgram &r, const std::vector<int64_t> &ids, int64_t root) {
  return std::any_of(ids.begin(), ids.end(), [&](int64_t id) { return storageOf(r, id) == root; });
}

/// Whether an instruction strictly between `lo` and `hi` (either order) of
/// `list`, not erased, reads (`reads`) or writes root `root`'s storage.
bool touchedBetween(const rt::RankProgram &r, const std::vector<rt::Instruction> &list,
                    const std::vector<bool> &erased, size_t lo, size_t hi, int64_t root, bool reads) {
  if (lo > hi)
    std::swap(lo, hi);
  for (size_t k = lo + 1; k < hi; ++k)
    if (!erased[k] && (anyRoot(r, list[k].out, root) || (reads && anyRoot(r, list[k].in, root))))
      return true;
  return false;
}

/// Whether `ins` reads root `root`'s storage (a result written there would
/// change an operand the kernel still reads: the norm gradient's column sums
/// read dy after dx is written).
bool readsRoot(const rt::RankProgram &r, const rt::Instruction &ins, int64_t root) {
  return anyRoot(r, ins.in, root);
}

/// A view of `id`'s storage with shape `shape` (`id` itself when it has it).
int64_t viewAs(rt::RankProgram &r, int64_t id, const rt::Shape &shape) {
  if (r.buffers[id].shape == shape)
    return id;
  rt::Buffer v = r.buffers[id];
  v.id = static_cast<int64_t>(r.buffers.size());
  v.name += ".view";
  v.shape = shape;
  v.viewOf = storageOf(r, id);
  r.buffers.push_back(v);
  return v.id;
}

/// The add that alone reads `x` (written by list[i] of program `name`) and
/// sums it with another tensor R of x's shape and dtype, where that add can
/// move up to list[i]: nothing in between writes R or touches the add's
/// result, and the result is none of list[i]'s operands (the kernel still
/// reads them). The result may be R's own buffer only when `inPlace`.
struct FoldedAdd {
  size_t at;
  int64_t res, out;
};
std::optional<FoldedAdd> foldableAdd(const rt::RankProgram &r, const std::vector<rt::Instruction> &list,
                                     const std::vector<bool> &erased, const Readers &readers,
                                     const std::set<int64_t> &kept, const std::string &name, size_t i, int64_t x,
                                     bool inPlace) {
  auto found = readers.find(x);
  if (kept.count(x) || r.buffers[x].viewOf >= 0 || found == readers.end() || found->second.size() != 1 ||
      found->second[0].first != name || found->second[0].second <= i)
    return std::nullopt;
  size_t j = found->second[0].second;
  const rt::Instruction &add = list[j];
  if (erased[j] || add.op != "add" || add.in.size() != 2 || add.out.size() != 1 ||
      (add.in[0] == x) == (add.in[1] == x))
    return std::nullopt;
  int64_t res = add.in[0] == x ? add.in[1] : add.in[0], y = add.out[0];
  const rt::Buffer &xb = r.buffers[x], &rb = r.buffers[res], &yb = r.buffers[y];
  bool aliased = storageOf(r, y) == storageOf(r, res) && !(inPlace && y == res);
  if (!floating(xb) || rb.shape != xb.shape || yb.shape != xb.shape || rb.dtype != xb.dtype ||
      yb.dtype != xb.dtype || aliased || readsRoot(r, list[i], storageOf(r, y)) ||
      touchedBetween(r, list, erased, i, j, storageOf(r, y), true) ||
      touchedBetween(r, list, erased, i, j, storageOf(r, res), false))
    return std::nullopt;
  return FoldedAdd{j, res, y};
}

/// The activation epilogues of GEMMs, as cuBLASLt runs them (GELU_AUX_BIAS,
/// DGELU, BGRADA, C with beta = 1); each removes a pass over a [tokens, n] tensor:
///  - bias_gelu: a bias-epilogue matmul followed by the tanh GELU of its
///    result; the pre-activation stays an output where anything else reads it.
///  - residual, bias_residual: a matmul whose result only a following add
///    of another tensor (the residual stream) reads.
///  - dgelu: a matmul whose result only the tanh GELU's gradient reads
///    (dY * gelu'(pre)); the gradient is written where the product was.
///  - bgrad: a bias gradient (reduce_sum over all but the last axis) of a
///    tensor that a weight-gradient matmul (X^T dY) also reads, summed by
///    that matmul over its k dimension.
int64_t activationEpilogues(rt::RankProgram &r, const std::set<int64_t> &kept) {
  int64_t removed = 0;
  // One rewrite over every instruction of every program, with the readers
  // as they were before it; instructions it marks in `erased` are dropped
  // after each program (indices stay valid meanwhile).
  using List = std::vector<rt::Instruction>;
  auto pass = [&](auto &&rewrite) {
    Readers readers = readersOf(r);
    for (auto &[name, list] : r.programs) {
      std::vector<bool> erased(list.size(), false);
      for (size_t i = 0; i < list.size(); ++i)
        if (!erased[i])
          rewrite(name, list, erased, readers, i);
      List out;
      for (size_t i = 0; i < list.size(); ++i)
        if (!erased[i])
          out.push_back(std::move(list[i]));
      removed += static_cast<int64_t>(list.size() - out.size());
      list = std::move(out);
    }
  };
  auto plainMatmul = [](const rt::Instruction &ins) {
    return ins.op == "matmul" && strAttr(ins, "epilogue").empty() && ins.in.size() == 2 && ins.out.size() == 1;
  };
  auto flag = mlir::loom::flagAttr;
  // Forward: bias_gelu.
  pass([&](const std::string &name, List &list, std::vector<bool> &erased, Readers &readers, size_t i) {
    if (i + 1 >= list.size())
      return;
    rt::Instruction &mm = list[i], &gelu = list[i + 1];
    if (mm.op != "matmul" || strAttr(mm, "epilogue") != "bias" || mm.out.size() != 1 || gelu.op != "gelu" ||
        !flag(gelu, "approximate") || gelu.in.size() != 1 || gelu.out.size() != 1 || gelu.in[0] != mm.out[0])
      return;
    int64_t pre = mm.out[0], y = gelu.out[0];
    const rt::Buffer &pb = r.buffers[pre], &yb = r.buffers[y];
    if (!floating(pb) || pb.dtype != yb.dtype || pb.shape != yb.shape || pb.viewOf >= 0)
      return;
    bool needPre = kept.count(pre) > 0;
    for (auto &[program, index] : readers[pre])
      needPre |= program != name || index != i + 1;
    mm.out = needPre ? std::vector<int64_t>{y, pre} : std::vector<int64_t>{y};
    mm.attrs["epilogue"] = "bias_gelu";
    erased[i + 1] = true;
  });
  // Residual adds: add(R, P) of a matmul's result P that nothing else reads
  // becomes that matmul's C input (cuBLASLt's beta = 1): bias_residual or residual.
  pass([&](const std::string &name, List &list, std::vector<bool> &erased, Readers &readers, size_t i) {
    rt::Instruction &mm = list[i];
    std::string epi = strAttr(mm, "epilogue");
    if (mm.op != "matmul" || mm.out.size() != 1 || !(epi == "bias" || (epi.empty() && mm.in.size() == 2)))
      return;
    auto add = foldableAdd(r, list, erased, readers, kept, name, i, mm.out[0], /*inPlace=*/false);
    if (!add)
      return;
    mm.in.push_back(add->res);
    mm.out = {add->out};
    mm.attrs["epilogue"] = epi.empty() ? "residual" : "bias_residual";
    erased[add->at] = true;
  });
  // Backward: the residual stream's gradient add(R, dx) after a norm's
  // gradient becomes its fourth input (dx + R written; R may be the result:
  // the kernel reads each element of R just before writing it).
  pass([&](const std::string &name, List &list, std::vector<bool> &erased, Readers &readers, size_t i) {
    rt::Instruction &ng = list[i];
    if ((ng.op != "layernorm_grad" && ng.op != "rmsnorm_grad") || ng.in.size() != 3 || ng.out.empty())
      return;
    auto add = foldableAdd(r, list, erased, readers, kept, name, i, ng.out[0], /*inPlace=*/true);
    if (!add)
      return;
    ng.in.push_back(add->res);
    ng.out[0] = add->out;
    erased[add->at] = true;
  });
  // Backward: dgelu.
  pass([&](const std::string &name, List &list, std::vector<bool> &erased, Readers &readers, size_t i) {
    rt::Instruction &mm = list[i];
    if (!plainMatmul(mm) || flag(mm, "transpose_a"))
      return;
    int64_t g = storageOf(r, mm.out[0]);
    const auto &gr = readers[g];
    if (kept.count(g) || gr.size() != 1 || gr[0].first != name || gr[0].second <= i)
      return;
    size_t j = gr[0].second;
    const rt::Instruction &ug = list[j];
    if (erased[j] || ug.op != "unary_grad" || strAttr(ug, "fn") != "gelu_tanh" || ug.in.size() != 3 ||
        ug.out.size() != 1 || storageOf(r, ug.in[2]) != g)
      return;
    int64_t pre = ug.in[0], d = ug.out[0];
    const rt::Buffer &gb = r.buffers[mm.out[0]], &db = r.buffers[d], &pb = r.buffers[pre];
    if (!floating(gb) || db.dtype != gb.dtype || pb.dtype != gb.dtype ||
        rt::numElements(db.shape) != rt::numElements(gb.shape) ||
        rt::numElements(pb.shape) != rt::numElements(gb.shape) ||
        touchedBetween(r, list, erased, i, j, storageOf(r, d), true) ||
        touchedBetween(r, list, erased, i, j, storageOf(r, pre), false))
      return;
    mm.in.push_back(pre);
    mm.out = {viewAs(r, d, gb.shape)};
    mm.attrs["epilogue"] = "dgelu";
    erased[j] = true;
  });
  // Backward: bgrad.
  pass([&](const std::string &, List &list, std::vector<bool> &erased, Readers &, size_t i) {
    const rt::Instruction &red = list[i];
    if (red.op != "reduce_sum" || red.in.size() != 1 || red.out.size() != 1)
      return;
    const rt::Buffer &x = r.buffers[red.in[0]], &db = r.buffers[red.out[0]];
    if (x.shape.size() < 2 || !floating(x) || db.dtype != x.dtype)
      return;
    std::set<int64_t> axes;
    if (auto it = red.attrs.find("axes"); red.attrs.is_object() && it != red.attrs.end() && it->is_array())
      for (const auto &a : *it)
        if (a.is_number_integer())
          axes.insert(a.get<int64_t>() < 0 ? a.get<int64_t>() + int64_t(x.shape.size()) : a.get<int64_t>());
    int64_t n = x.shape.back();
    if (axes.size() != x.shape.size() - 1 || axes.count(int64_t(x.shape.size()) - 1) ||
        rt::numElements(db.shape) != n)
      return;
    int64_t root = storageOf(r, red.in[0]), dbRoot = storageOf(r, red.out[0]);
    for (size_t j = 0; j < list.size(); ++j) {
      rt::Instruction &mm = list[j];
      if (j == i || erased[j] || !plainMatmul(mm) || !flag(mm, "transpose_a") || flag(mm, "transpose_b"))
        continue;
      const rt::Buffer &b = r.buffers[mm.in[1]], &o = r.buffers[mm.out[0]];
      if (storageOf(r, mm.in[1]) != root || b.shape.size() != 2 || b.shape[1] != n || o.dtype != db.dtype ||
          touchedBetween(r, list, erased, i, j, dbRoot, true) || touchedBetween(r, list, erased, i, j, root, false))
        continue;
      mm.out.push_back(red.out[0]);
      mm.attrs["epilogue"] = "bgrad";
      erased[i] = true;
      return;
    }
  });
  return removed;
}

/// Batch norm then ReLU, as ResNet has after most convolutions, become one
/// instruction each way:
///   batchnorm(x, g, b) -> y; relu(y) -> a
///     => batchnorm{activation = relu}(x, g, b) -> a
///   unary_grad{fn = relu}(y, a, da) -> dy; batchnorm_grad(x, g, dy) -> dx, dg, db
///     => batchnorm_grad{activation = relu}(x, g, da, a) -> dx, dg, db
/// where y has no other reader and dy none but the batch norm's gradient,
/// so neither is written: one pass less over the activation each way. The
/// gradient moves its reads of da and a down to where it is, so nothing in
/// between may write them; the batch norm writes a early, so nothing in
/// between may touch it. Runs before the chains take the ReLUs.
int64_t batchNormRelu(rt::RankProgram &r, const std::set<int64_t> &kept) {
  Readers readers = readersOf(r);
  std::map<std::string, std::vector<bool>> erased;
  for (auto &[name, list] : r.programs)
    erased[name].assign(list.size(), false);
  int64_t removed = 0;
  for (auto &[name, list] : r.programs)
    for (size_t i = 0; i < list.size(); ++i) {
      rt::Instruction &bn = list[i];
      if (erased[name][i] || bn.op != "batchnorm" || bn.in.size() != 3 || bn.out.size() != 1 ||
          !strAttr(bn, "activation").empty())
        continue;
      int64_t y = bn.out[0];
      auto found = readers.find(y);
      if (kept.count(y) || r.buffers[y].viewOf >= 0 || found == readers.end())
        continue;
      std::optional<size_t> relu;
      std::optional<std::pair<std::string, size_t>> grad;
      bool other = false;
      for (const auto &[program, index] : found->second) {
        const rt::Instruction &ins = r.programs[program][index];
        if (!relu && program == name && index > i && ins.op == "relu" && ins.in.size() == 1 && ins.in[0] == y &&
            ins.out.size() == 1)
          relu = index;
        else if (!grad && ins.op == "unary_grad" && strAttr(ins, "fn") == "relu" && ins.in.size() == 3 &&
                 ins.in[0] == y && ins.out.size() == 1)
          grad = std::make_pair(program, index);
        else
          other = true;
      }
      if (other || !relu || erased[name][*relu])
        continue;
      int64_t a = list[*relu].out[0];
      const rt::Buffer &yb = r.buffers[y], &ab = r.buffers[a];
      if (!floating(yb) || ab.dtype != yb.dtype || ab.shape != yb.shape || kept.count(storageOf(r, a)) > 0 ||
          touchedBetween(r, list, erased[name], i, *relu, storageOf(r, a), true) ||
          anyRoot(r, bn.in, storageOf(r, a)))
        continue;
      std::optional<size_t> bnGrad;
      if (grad) {
        std::vector<rt::Instruction> &glist = r.programs[grad->first];
        const rt::Instruction &ug = glist[grad->second];
        int64_t dy = ug.out[0], da = ug.in[2];
        auto dyReaders = readers.find(dy);
        if (ug.in[1] != a || kept.count(dy) || r.buffers[dy].viewOf >= 0 || storageOf(r, dy) == storageOf(r, da) ||
            dyReaders == readers.end() || dyReaders->second.size() != 1 ||
            dyReaders->second[0].first != grad->first || dyReaders->second[0].second <= grad->second)
          continue;
        size_t l = dyReaders->second[0].second;
        const rt::Instruction &bg = glist[l];
        if (erased[grad->first][l] || bg.op != "batchnorm_grad" || bg.in.size() != 3 || bg.in[2] != dy ||
            bg.in[0] != bn.in[0] || bg.in[1] != bn.in[1] || strAttr(bg, "layout") != strAttr(bn, "layout") ||
            !strAttr(bg, "activation").empty() ||
            touchedBetween(r, glist, erased[grad->first], grad->second, l, storageOf(r, da), false) ||
            touchedBetween(r, glist, erased[grad->first], grad->second, l, storageOf(r, a), false))
          continue;
        bnGrad = l;
      }
      bn.out = {a};
      bn.attrs["activation"] = "relu";
      erased[name][*relu] = true;
      ++removed;
      if (grad) {
        std::vector<rt::Instruction> &glist = r.programs[grad->first];
        rt::Instruction &bg = glist[*bnGrad];
        bg.in = {bg.in[0], bg.in[1], glist[grad->second].in[2], a};
        bg.attrs["activation"] = "relu";
        erased[grad->first][grad->second] = true;
        ++removed;
      }
    }
  for (auto &[name, list] : r.programs) {
    std::vector<rt::Instruction> out;
    for (size_t i = 0; i < list.size(); ++i)
      if (!erased[name][i])
        out.push_back(std::move(list[i]));
    list = std::move(out);
  }
  return removed;
}

/// Fuses the chains of this round. A chain starts at a fusable instruction
/// and takes each later fusable instruction of its shape that reads one of
/// its results (not through a view); it may pass over up to kSkip other
/// instructions, which then run before it (the fused kernel takes the last
/// member's place), so none of them may read a member's result or write
/// anything a member reads or writes: Llama's silu(gate) * up has the up
/// projection between its two steps.
int64_t fuseChains(rt::RankProgram &r, int64_t &nextKernel, const std::set<int64_t> &kept, Round round) {
  constexpr size_t kSkip = 8;
  Readers readers = readersOf(r);
  int64_t removed = 0;
  for (auto &[name, list] : r.programs) {
    std::vector<bool> taken(list.size(), false);
    std::map<size_t, rt::Instruction> fusedAt; // by its last member's index
    for (size_t i = 0; i < list.size(); ++i) {
      if (taken[i] || !fusable(r, list[i], round))
        continue;
      const rt::Shape &shape = r.buffers[list[i].out[0]].shape;
      std::vector<size_t> members = {i};
      std::set<int64_t> produced = {list[i].out[0]}, touched;
      auto take = [&](const rt::Instruction &ins) {
        for (int64_t id : ins.in)
          touched.insert(storageOf(r, id));
        for (int64_t id : ins.out)
          touched.insert(storageOf(r, id));
      };
      take(list[i]);
      size_t skipped = 0;
      for (size_t k = i + 1; k < list.size() && !taken[k] && skipped <= kSkip; ++k) {
        const rt::Instruction &ins = list[k];
        bool reads = false, throughView = false;
        for (int64_t id : ins.in)
          if (produced.count(storageOf(r, id))) {
            reads = true;
            throughView |= id != storageOf(r, id);
          }
        if (reads && !throughView && fusable(r, ins, round) && r.buffers[ins.out[0]].shape == shape) {
          members.push_back(k);
          produced.insert(ins.out[0]);
          take(ins);
          skipped = 0;
          continue;
        }
        bool writes = std::any_of(ins.out.begin(), ins.out.end(),
                                  [&](int64_t id) { return touched.count(storageOf(r, id)) > 0; });
        if (reads || writes)
          break;
        ++skipped;
      }
      if (members.size() < 2)
        continue;
      std::set<size_t> inChain(members.begin(), members.end());
      // Values: the chain's external inputs, then one per step.
      std::vector<int64_t> inputs;
      std::map<int64_t, int> valueOf; // buffer id (an input or a step's output) -> value
      for (size_t k : members)
        for (int64_t id : list[k].in)
          if (!produced.count(storageOf(r, id)) && !valueOf.count(id)) {
            valueOf[id] = static_cast<int>(inputs.size());
            inputs.push_back(id);
          }
      json steps = json::array();
      int next = static_cast<int>(inputs.size());
      std::vector<int64_t> outputs;
      json results = json::array();
      for (size_t k : members) {
        json step = {{"op", list[k].op}};
        for (auto &[key, value] : list[k].attrs.items())
          step[key] = value;
        json args = json::array();
        for (int64_t id : list[k].in)
          args.push_back(produced.count(storageOf(r, id)) ? valueOf.at(storageOf(r, id)) : valueOf.at(id));
        step["args"] = args;
        steps.push_back(step);
        int64_t result = list[k].out[0];
        valueOf[result] = next++;
        // Written out only when read outside the chain (or kept, or the last).
        bool outside = kept.count(result) || k == members.back();
        for (auto &[program, index] : readers[result])
          outside |= program != name || !inChain.count(index);
        if (outside) {
          outputs.push_back(result);
          results.push_back(valueOf[result]);
        }
        taken[k] = true;
      }
      rt::Instruction fused;
      fused.op = "fused";
      fused.in = inputs;
      fused.out = outputs;
      // Each thread loads and stores 16 bytes of each full-size tensor
      // (4 f32 or 8 bf16 elements; fewer where they do not divide the
      // count), in blocks of 256 threads.
      int64_t elements = rt::numElements(shape).value_or(0), vector = round == Round::Bf16 ? 8 : 4;
      while (vector > 1 && elements % vector)
        vector /= 2;
      int64_t threads = elements / vector;
      fused.attrs = {{"kernel", "fused_" + std::to_string(nextKernel++)},
                     {"launch", {{"grid", (threads + 255) / 256}, {"block", 256}, {"vector", vector}}},
                     {"steps", steps},
                     {"results", results}};
      fusedAt[members.back()] = std::move(fused);
      removed += static_cast<int64_t>(members.size()) - 1;
    }
    std::vector<rt::Instruction> out;
    for (size_t k = 0; k < list.size(); ++k)
      if (auto f = fusedAt.find(k); f != fusedAt.end())
        out.push_back(std::move(f->second));
      else if (!taken[k])
        out.push_back(std::move(list[k]));
    list = std::move(out);
  }
  return removed;
}

/// The widest vector (up to 16 bytes) that splits `h` into `lanes` equal
/// shares of whole vectors; 0 where not even single elements do.
int64_t widest(int64_t h, int64_t lanes, bool bf16) {
  int64_t v = bf16 ? 8 : 4;
  while (v > 1 && h % (lanes * v))
    v /= 2;
  return h % (lanes * v) == 0 ? v : int64_t(0);
}

/// Norms and softmaxes over the last axis get a generated kernel (a warp per
/// row, the row in registers; KernelWriter::writeRows) where the row splits
/// into 32 lanes of whole vectors (up to 16 bytes), at most 16 each, and the
/// operands are f32 or bf16 with gamma and beta of the row's length; the
/// cross-entropy loss and its gradient (a block per row;
/// KernelWriter::writeCrossEntropy) where the vocabulary is not split over
/// ranks. The instruction keeps its op (the CPU backend runs it as before);
/// "kernel" and "launch" name what the GPU runs instead of its own kernel.
void rowKernels(rt::RankProgram &r, int64_t &nextKernel) {
  std::map<std::string, std::string> named; // one kernel per op, dtypes, shape and eps
  for (auto &[name, list] : r.programs)
    for (rt::Instruction &ins : list) {
      if (ins.out.size() != 1 || ins.in.empty())
        continue;
      const rt::Buffer &x = r.buffers[ins.in[0]], &y = r.buffers[ins.out[0]];
      if (x.shape.empty() || !floating(x) || !floating(y))
        continue;
      int64_t h = x.shape.back(), v = 0;
      if (ins.op == "layernorm" || ins.op == "rmsnorm" || ins.op == "softmax") {
        if (ins.in.size() != (ins.op == "layernorm" ? 3u : ins.op == "rmsnorm" ? 2u : 1u) || x.shape != y.shape)
          continue;
        if (ins.op == "softmax" && ins.attrs.is_object()) {
          int64_t axis = ins.attrs.value("axis", int64_t(-1));
          if (axis != -1 && axis != int64_t(x.shape.size()) - 1)
            continue;
        }
        v = widest(h, 32, x.dtype == LOOM_BF16);
        bool ok = v > 0 && h / (32 * v) <= 16;
        for (size_t k = 1; k < ins.in.size(); ++k)
          ok &= floating(r.buffers[ins.in[k]]) && r.buffers[ins.in[k]].shape == rt::Shape{h};
        if (!ok)
          continue;
      } else if (ins.op == "cross_entropy" || ins.op == "cross_entropy_grad") {
        bool grad = ins.op == "cross_entropy_grad";
        if (ins.in.size() != (grad ? 3u : 2u) || (ins.attrs.is_object() && ins.attrs.contains("vocab_group")))
          continue; // a vocabulary split over ranks combines its statistics first: the runtime's kernels
        const rt::Buffer &t = r.buffers[ins.in[1]];
        if ((t.dtype != LOOM_I32 && t.dtype != LOOM_I64) || t.shape != rt::Shape(x.shape.begin(), x.shape.end() - 1))
          continue;
        if (grad ? (y.shape != x.shape || y.dtype != x.dtype || r.buffers[ins.in[2]].dtype != LOOM_F32 ||
                    rt::numElements(r.buffers[ins.in[2]].shape) != 1)
                 : (y.dtype != LOOM_F32 || rt::numElements(y.shape) != 1))
          continue;
        v = widest(h, 1, x.dtype == LOOM_BF16);
        if (v == 0)
          continue;
      } else {
        continue;
      }
      int64_t rows = rt::numElements(x.shape).value_or(0) / h;
      bool perRow = ins.op.rfind("cross_entropy", 0) == 0;
      if (!ins.attrs.is_object())
        ins.attrs = json::object();
      std::string signature = ins.op + " " + json(x.shape).dump() + " " + json(ins.attrs.value("eps", 0.0)).dump();
      for (int64_t id : ins.in)
        signature += " " + std::to_string(r.buffers[id].dtype);
      signature += " " + std::to_string(y.dtype);
      std::string &kernel = named[signature];
      if (kernel.empty())
        kernel = (perRow ? "ce_" : "row_") + std::to_string(nextKernel++);
      ins.attrs["kernel"] = kernel;
      ins.attrs["launch"] = {{"grid", perRow ? rows : (rows + 7) / 8}, {"block", 256}, {"vector", v}};
    }
}

/// Blocks of a generated norm gradient: four for each of sm_90's 132 SMs,
/// fewer where the rows run out.
constexpr int64_t kNormGradBlocks = 4 * 132;

/// Norm gradients (layernorm_grad, rmsnorm_grad, with or without the
/// residual stream's gradient) get two generated kernels
/// (KernelWriter::writeNormGrad) where the row splits into 32 lanes of whole
/// vectors, at most 64 elements a lane (h <= 2048), and every operand is f32
/// or bf16 of the shapes the op takes. A block has as many warps as keep
/// their accumulators (2 h floats each for LayerNorm, h for RMSNorm) within
/// 32 KB of workgroup memory, up to 8; "launch" gives its grid, block, vector
/// width and rows per block.
void normGradKernels(rt::RankProgram &r, int64_t &nextKernel) {
  std::map<std::string, std::string> named; // one kernel per op, shapes, dtypes and eps
  for (auto &[name, list] : r.programs)
    for (rt::Instruction &ins : list) {
      bool rms = ins.op == "rmsnorm_grad";
      if ((!rms && ins.op != "layernorm_grad") || (ins.in.size() != 3 && ins.in.size() != 4) ||
          ins.out.size() != (rms ? 2u : 3u))
        continue;
      const rt::Buffer &x = r.buffers[ins.in[0]];
      if (x.shape.empty())
        continue;
      int64_t h = x.shape.back(), v = widest(h, 32, x.dtype == LOOM_BF16);
      bool ok = h > 0 && v > 0 && h / 32 <= 64;
      for (int64_t id : ins.in)
        ok &= floating(r.buffers[id]);
      for (int64_t id : ins.out)
        ok &= floating(r.buffers[id]);
      ok &= r.buffers[ins.in[1]].shape == rt::Shape{h} && r.buffers[ins.in[2]].shape == x.shape &&
            r.buffers[ins.out[0]].shape == x.shape;
      if (ins.in.size() == 4)
        ok &= r.buffers[ins.in[3]].shape == x.shape;
      for (size_t k = 1; k < ins.out.size(); ++k)
        ok &= r.buffers[ins.out[k]].shape == rt::Shape{h};
      if (!ok)
        continue;
      int64_t rows = rt::numElements(x.shape).value_or(0) / h;
      int64_t width = (rms ? 1 : 2) * h, warps = std::clamp<int64_t>(8192 / width, 1, 8);
      int64_t perBlock = (rows + kNormGradBlocks - 1) / kNormGradBlocks;
      perBlock = std::max<int64_t>(warps, (perBlock + warps - 1) / warps * warps);
      int64_t grid = std::max<int64_t>(1, (rows + perBlock - 1) / perBlock);
      if (!ins.attrs.is_object())
        ins.attrs = json::object();
      std::string signature = ins.op + " " + json(x.shape).dump() + " " + json(ins.attrs.value("eps", 0.0)).dump();
      for (const std::vector<int64_t> *ids : {&ins.in, &ins.out})
        for (int64_t id : *ids)
          signature += " " + std::to_string(r.buffers[id].dtype);
      std::string &kernel = named[signature];
      if (kernel.empty())
        kernel = "ngrad_" + std::to_string(nextKernel++);
      ins.attrs["kernel"] = kernel;
      ins.attrs["launch"] = {{"grid", grid}, {"block", 32 * warps}, {"vector", v}, {"rows", perBlock}};
    }
}

/// The cross-entropy loss and its gradient over a vocabulary split over
/// ranks (`vocab_group`) get generated kernels (KernelWriter::writeVocabLoss)
/// where the logits are f32 or bf16 rows of whole vectors (up to 16 bytes)
/// and the targets integer: "launch" gives the grid (a block of 256 per
/// row), the vector width, and where this rank's columns start in the whole
/// vocabulary ("start" of "full"), so each rank has kernels of its own.
void vocabLossKernels(rt::RankProgram &r, int64_t &nextKernel) {
  std::map<std::string, std::string> named;
  for (auto &[name, list] : r.programs)
    for (rt::Instruction &ins : list) {
      bool grad = ins.op == "cross_entropy_grad", loss = ins.op == "cross_entropy";
      if ((!grad && !loss) || !ins.attrs.is_object() || !ins.attrs.contains("vocab_group") ||
          !ins.attrs["vocab_group"].is_string() || ins.in.size() != (grad ? 3u : 2u) || ins.out.empty() ||
          ins.out.size() > (grad ? 1u : 2u))
        continue;
      const rt::Buffer &x = r.buffers[ins.in[0]], &t = r.buffers[ins.in[1]];
      auto group = r.groups.find(ins.attrs["vocab_group"].get<std::string>());
      if (x.shape.empty() || !floating(x) || (t.dtype != LOOM_I32 && t.dtype != LOOM_I64) ||
          t.shape != rt::Shape(x.shape.begin(), x.shape.end() - 1) || group == r.groups.end())
        continue;
      bool fused = loss && ins.out.size() == 2;
      if ((fused && ins.out[1] != ins.in[0]) || (!grad && (r.buffers[ins.out[0]].dtype != LOOM_F32 ||
                                                            rt::numElements(r.buffers[ins.out[0]].shape) != 1)))
        continue;
      if (grad && (r.buffers[ins.out[0]].shape != x.shape || r.buffers[ins.out[0]].dtype != x.dtype ||
                   r.buffers[ins.in[2]].dtype != LOOM_F32 || rt::numElements(r.buffers[ins.in[2]].shape) != 1))
        continue;
      const std::vector<int64_t> &members = group->second;
      auto at = std::find(members.begin(), members.end(), r.rank);
      if (at == members.end())
        continue;
      int64_t h = x.shape.back(), v = widest(h, 1, x.dtype == LOOM_BF16);
      int64_t start = int64_t(at - members.begin()) * h, full = h * int64_t(members.size());
      int64_t rows = rt::numElements(t.shape).value_or(0);
      std::string signature = ins.op + " " + std::to_string(ins.out.size()) + " " + json(x.shape).dump() + " " +
                              std::to_string(x.dtype) + " " + std::to_string(t.dtype) + " " +
                              std::to_string(start) + " " + std::to_string(full) + " " +
                              json(ins.attrs.value("grad_scale", 1.0)).dump();
      std::string &kernel = named[signature];
      if (kernel.empty())
        kernel = "vce_" + std::to_string(nextKernel++);
      ins.attrs["kernel"] = kernel;
      ins.attrs["launch"] = {{"grid", rows}, {"block", 256}, {"vector", v}, {"start", start}, {"full", full}};
    }
}

/// Elements of one tensor each block of the generated AdamW updates.
constexpr int64_t kAdamChunk = 2048;

/// Each run of consecutive in-place AdamW instructions with the same
/// hyperparameters but weight decay (f32 parameter and moments, f32 or bf16 gradient) gets one
/// generated kernel (KernelWriter::writeAdam): a block per 2048-element chunk
/// of one tensor, found by a binary search over the run's chunk starts; the
/// tensors are addressed by their offsets in the arena, which the kernel
/// takes as its first argument. Every member names the kernel; "launch"
/// says how many tensors the run has, so a runtime that groups them
/// otherwise can tell.
void adamKernels(rt::RankProgram &r, int64_t &nextKernel) {
  auto eligible = [&](const rt::Instruction &ins) {
    if (ins.op != "adamw" || ins.in.size() != 6 || (ins.out.size() != 3 && ins.out.size() != 4) ||
        ins.out[0] != ins.in[0] || ins.out[1] != ins.in[2] || ins.out[2] != ins.in[3])
      return false;
    auto n = rt::numElements(r.buffers[ins.in[0]].shape);
    // The bf16 copy it writes (loom-update-copies).
    if (ins.out.size() == 4 && (r.buffers[ins.out[3]].dtype != LOOM_BF16 ||
                                rt::numElements(r.buffers[ins.out[3]].shape) != n))
      return false;
    for (int k : {0, 2, 3, 4, 5})
      if (r.buffers[ins.in[k]].dtype != LOOM_F32)
        return false;
    for (int k : {2, 3, 1})
      if (rt::numElements(r.buffers[ins.in[k]].shape) != n)
        return false;
    return floating(r.buffers[ins.in[1]]);
  };
  for (auto &[name, list] : r.programs)
    for (size_t i = 0; i < list.size();) {
      if (!eligible(list[i])) {
        ++i;
        continue;
      }
      // Weight decay may differ (biases and norms usually have none): it is per tensor.
      auto hyper = [](const rt::Instruction &ins) {
        json a = ins.attrs.is_object() ? ins.attrs : json::object();
        a.erase("weight_decay");
        return a;
      };
      size_t j = i + 1;
      while (j < list.size() && eligible(list[j]) && hyper(list[j]) == hyper(list[i]) &&
             list[j].in[4] == list[i].in[4] && list[j].in[5] == list[i].in[5])
        ++j;
      int64_t chunks = 0;
      for (size_t k = i; k < j; ++k)
        chunks += (rt::numElements(r.buffers[list[k].in[0]].shape).value_or(0) + kAdamChunk - 1) / kAdamChunk;
      std::string kernel = "adam_" + std::to_string(nextKernel++);
      json launch = {{"grid", chunks}, {"block", 256}, {"tensors", int64_t(j - i)}, {"chunk", kAdamChunk}};
      for (size_t k = i; k < j; ++k) {
        if (!list[k].attrs.is_object())
          list[k].attrs = json::object();
        list[k].attrs["kernel"] = kernel;
        list[k].attrs["launch"] = launch;
      }
      i = j;
    }
}

} // namespace

int64_t mlir::loom::fuseElementwise(rt::RankProgram &r, int64_t &nextKernel) {
  // What must outlive the program.
  std::set<int64_t> kept;
  for (const rt::NamedBuffer &nb : r.outputs)
    kept.insert(storageOf(r, nb.buffer));
  for (const rt::Parameter &p : r.params)
    if (p.grad >= 0)
      kept.insert(storageOf(r, p.grad));
  int64_t removed = batchNormRelu(r, kept);
  removed += fuseChains(r, nextKernel, kept, Round::F32);
  Readers readers = readersOf(r);
  // GEMM epilogues: a matmul whose result only a following bias add reads
  // (a bias add no elementwise chain took, such as q|k|v's before its
  // slices) becomes a matmul with epilogue "bias".
  for (auto &[name, list] : r.programs) {
    std::vector<rt::Instruction> out;
    for (size_t i = 0; i < list.size(); ++i) {
      rt::Instruction &mm = list[i];
      if (mm.op == "matmul" && i + 1 < list.size() && !mm.attrs.contains("epilogue") &&
          mm.out.size() == 1 &&
          (r.buffers[mm.out[0]].dtype == LOOM_F32 || r.buffers[mm.out[0]].dtype == LOOM_BF16) &&
          r.buffers[mm.out[0]].role == rt::BufferRole::Activation) {
        rt::Instruction &add = list[i + 1];
        int64_t c = mm.out[0];
        const rt::Shape &shape = r.buffers[c].shape;
        bool onlyReader = readers[c].size() == 1 && !kept.count(c);
        if (add.op == "add" && onlyReader && add.in.size() == 2 && add.in[0] == c &&
            r.buffers[add.out[0]].shape == shape && r.buffers[add.in[1]].dtype == r.buffers[c].dtype &&
            r.buffers[add.out[0]].dtype == r.buffers[c].dtype &&
            r.buffers[add.in[1]].shape == rt::Shape{shape.back()}) {
          mm.in.push_back(add.in[1]);
          mm.out = add.out;
          mm.attrs["epilogue"] = "bias";
          out.push_back(std::move(mm));
          ++i, ++removed;
          continue;
        }
      }
      out.push_back(std::move(list[i]));
    }
    list = std::move(out);
  }
  removed += activationEpilogues(r, kept);
  removed += fuseChains(r, nextKernel, kept, Round::Bf16);
  rowKernels(r, nextKernel);
  normGradKernels(r, nextKernel);
  vocabLossKernels(r, nextKernel);
  adamKernels(r, nextKernel);
  return removed;
}
