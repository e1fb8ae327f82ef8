//===- KernelGen.cpp - GPU kernels generated through MLIR's gpu dialect ---===//
//
// The PTX of every kernel the fusion rewrites name (compiler/bundle/Fusion.cpp):
// each is written as a gpu.func in MLIR's textual form (arith, math, memref,
// vector, scf and gpu ops) and lowered with convert-gpu-to-nvvm and
// gpu-module-to-binary, so the compile host needs no CUDA toolkit.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/KernelGen.h"
#include "passes/Fusion.h"

#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/InitAllDialects.h"
#include "mlir/InitAllExtensions.h"
#include "mlir/InitAllPasses.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Pass/PassRegistry.h"
#include "mlir/Target/LLVMIR/Dialect/All.h"

#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>
#include <set>
#include <sstream>

using namespace mlir;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

/// Writes one fused instruction as a gpu.func over flat memrefs. Each
/// thread handles V consecutive output elements (the launch's "vector"):
/// full-size tensors, and broadcast ones that keep the innermost axis, are
/// memrefs of vector<V x T> (one 16-byte load or store), a tensor constant
/// along rows is one scalar load, anything else a load per element. The
/// chain runs per element in f32 (bf16 widened on load, rounded once on
/// store), as the CPU backend evaluates it.
class KernelWriter {
public:
  KernelWriter(const rt::RankProgram &r, const rt::Instruction &ins) : r(r), ins(ins) {}

  std::string write() {
    const rt::Shape &shape = r.buffers[ins.out[0]].shape;
    int64_t n = rt::numElements(shape).value_or(0), v = 1;
    if (auto launch = ins.attrs.find("launch"); launch != ins.attrs.end() && launch->is_object())
      v = launch->value("vector", int64_t(1));
    V = v;
    // How each input is read (see above).
    enum class Access { Vector, RowVector, Splat, PerElement };
    std::vector<Access> access;
    for (int64_t id : ins.in) {
      const rt::Shape &in = r.buffers[id].shape;
      bool rowsOfV = !shape.empty() && shape.back() % V == 0;
      if (in == shape)
        access.push_back(Access::Vector);
      else if (rowsOfV && !in.empty() && in.back() == shape.back())
        access.push_back(Access::RowVector);
      else if (rowsOfV && (in.empty() || in.back() == 1))
        access.push_back(Access::Splat);
      else
        access.push_back(Access::PerElement);
    }
    auto vectorMemref = [&](int64_t id) {
      return "memref<" + std::to_string(count(id) / V) + "xvector<" + std::to_string(V) + "x" + elem(id) + ">>";
    };
    auto scalarMemref = [&](int64_t id) { return "memref<" + std::to_string(count(id)) + "x" + elem(id) + ">"; };
    std::vector<std::string> inType;
    for (size_t k = 0; k < ins.in.size(); ++k)
      inType.push_back(access[k] == Access::Vector || access[k] == Access::RowVector ? vectorMemref(ins.in[k])
                                                                                     : scalarMemref(ins.in[k]));
    os << "    gpu.func @" << ins.attrs.at("kernel").get<std::string>() << "(";
    for (size_t k = 0; k < ins.in.size(); ++k)
      os << (k ? ", " : "") << "%in" << k << ": " << inType[k];
    for (size_t k = 0; k < ins.out.size(); ++k)
      os << ", %out" << k << ": " << vectorMemref(ins.out[k]);
    os << ") kernel {\n";
    line("%bid = gpu.block_id x");
    line("%bdim = gpu.block_dim x");
    line("%tid = gpu.thread_id x");
    line("%base = arith.muli %bid, %bdim : index");
    line("%i = arith.addi %base, %tid : index");
    line("%n = arith.constant " + std::to_string(n / V) + " : index");
    line("%inside = arith.cmpi ult, %i, %n : index");
    line("scf.if %inside {");
    line("%e = arith.muli %i, " + constIndex(V) + " : index"); // the first element
    // lanes[l][k]: input k's value (f32) for element e + l.
    std::vector<std::vector<std::string>> lanes(V, std::vector<std::string>(ins.in.size()));
    for (size_t k = 0; k < ins.in.size(); ++k) {
      std::string arg = "%in" + std::to_string(k), ty = elem(ins.in[k]);
      switch (access[k]) {
      case Access::Vector:
      case Access::RowVector: {
        std::string at = "%i";
        if (access[k] == Access::RowVector) {
          at = tmp();
          line(at + " = arith.divui " + inputIndex(ins.in[k], shape, "%e") + ", " + constIndex(V) + " : index");
        }
        std::string vec = tmp();
        line(vec + " = memref.load " + arg + "[" + at + "] : " + inType[k]);
        for (int64_t l = 0; l < V; ++l) {
          std::string x = tmp();
          line(x + " = vector.extract " + vec + "[" + std::to_string(l) + "] : " + ty + " from vector<" +
               std::to_string(V) + "x" + ty + ">");
          lanes[l][k] = widen(x, ty);
        }
        break;
      }
      case Access::Splat: {
        std::string x = tmp();
        line(x + " = memref.load " + arg + "[" + inputIndex(ins.in[k], shape, "%e") + "] : " + inType[k]);
        std::string f = widen(x, ty);
        for (int64_t l = 0; l < V; ++l)
          lanes[l][k] = f;
        break;
      }
      case Access::PerElement:
        for (int64_t l = 0; l < V; ++l) {
          std::string el = "%e";
          if (l) {
            el = tmp();
            line(el + " = arith.addi %e, " + constIndex(l) + " : index");
          }
          std::string x = tmp();
          line(x + " = memref.load " + arg + "[" + inputIndex(ins.in[k], shape, el) + "] : " + inType[k]);
          lanes[l][k] = widen(x, ty);
        }
        break;
      }
    }
    // The chain, element by element.
    for (int64_t l = 0; l < V; ++l)
      for (const json &step : ins.attrs.at("steps")) {
        std::vector<std::string> a;
        for (const json &arg : step.at("args"))
          a.push_back(lanes[l].at(arg.get<size_t>()));
        lanes[l].push_back(emitStep(step, a));
      }
    const json &results = ins.attrs.at("results");
    for (size_t k = 0; k < ins.out.size(); ++k) {
      std::vector<std::string> values;
      for (int64_t l = 0; l < V; ++l)
        values.push_back(lanes[l].at(results[k].get<size_t>()));
      line("memref.store " + packLanes(values, elem(ins.out[k])) + ", %out" + std::to_string(k) + "[%i] : " +
           vectorMemref(ins.out[k]));
    }
    line("}");
    line("gpu.return");
    os << "    }\n";
    return os.str();
  }

  /// A norm or softmax over the last axis (attrs "kernel", "launch"): a warp
  /// per row, eight rows per block of 256 threads, each lane holding its
  /// h / 32 elements in registers as f32 (loaded and stored V at a time),
  /// sums and maxima over the row by warp shuffles; two passes over the
  /// registers for the variance, as the CPU backend computes it.
  std::string writeRows() {
    const rt::Buffer &x = r.buffers[ins.in[0]];
    int64_t h = x.shape.back(), rows = count(ins.in[0]) / h;
    V = ins.attrs.at("launch").value("vector", int64_t(1));
    int64_t chunks = h / (32 * V);
    bool softmax = ins.op == "softmax", rms = ins.op == "rmsnorm";
    auto vtype = [&](int64_t id) { return "vector<" + std::to_string(V) + "x" + elem(id) + ">"; };
    auto memref = [&](int64_t id) { return "memref<" + std::to_string(count(id) / V) + "x" + vtype(id) + ">"; };
    os << "    gpu.func @" << ins.attrs.at("kernel").get<std::string>() << "(";
    for (size_t k = 0; k < ins.in.size(); ++k)
      os << (k ? ", " : "") << "%in" << k << ": " << memref(ins.in[k]);
    os << ", %out0: " << memref(ins.out[0]) << ") kernel {\n";
    line("%bid = gpu.block_id x");
    line("%tid = gpu.thread_id x");
    line("%warp = arith.divui %tid, " + constIndex(32) + " : index");
    line("%lane = arith.remui %tid, " + constIndex(32) + " : index");
    line("%rows8 = arith.muli %bid, " + constIndex(8) + " : index");
    line("%row = arith.addi %rows8, %warp : index");
    line("%inside = arith.cmpi ult, %row, " + constIndex(rows) + " : index");
    line("scf.if %inside {");
    line("%rowBase = arith.muli %row, " + constIndex(h / V) + " : index");
    std::vector<std::string> col(chunks), at(chunks);
    std::vector<std::vector<std::string>> v(chunks);
    for (int64_t c = 0; c < chunks; ++c) {
      col[c] = tmp(), at[c] = tmp();
      line(col[c] + " = arith.addi %lane, " + constIndex(32 * c) + " : index");
      line(at[c] + " = arith.addi %rowBase, " + col[c] + " : index");
      v[c] = loadLanes("%in0", ins.in[0], at[c], memref(ins.in[0]));
    }
    auto reduceAll = [&](auto &&value, const char *combine, std::string acc) {
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t l = 0; l < V; ++l)
          acc = op(combine, acc, value(v[c][l]));
      return warpReduce(acc, combine);
    };
    auto same = [](const std::string &a) { return a; };
    std::vector<std::vector<std::string>> y(chunks, std::vector<std::string>(V));
    if (softmax) {
      std::string mx = reduceAll(same, "arith.maximumf", constF(-INFINITY));
      std::vector<std::vector<std::string>> e(chunks, std::vector<std::string>(V));
      std::string sum = constF(0);
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t l = 0; l < V; ++l)
          e[c][l] = op("math.exp", op("arith.subf", v[c][l], mx)), sum = op("arith.addf", sum, e[c][l]);
      std::string inv = op("arith.divf", constF(1), warpReduce(sum, "arith.addf"));
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t l = 0; l < V; ++l)
          y[c][l] = op("arith.mulf", e[c][l], inv);
    } else {
      std::string mean = constF(0);
      if (!rms)
        mean = op("arith.mulf", reduceAll(same, "arith.addf", constF(0)), constF(1.0 / double(h)));
      auto square = [&](const std::string &a) {
        std::string d = op("arith.subf", a, mean);
        return op("arith.mulf", d, d);
      };
      std::string var = op("arith.mulf", reduceAll(square, "arith.addf", constF(0)), constF(1.0 / double(h)));
      std::string inv = op("math.rsqrt", op("arith.addf", var, constF(ins.attrs.value("eps", 1e-5))));
      for (int64_t c = 0; c < chunks; ++c) {
        std::vector<std::string> g = loadLanes("%in1", ins.in[1], col[c], memref(ins.in[1]));
        std::vector<std::string> b;
        if (!rms)
          b = loadLanes("%in2", ins.in[2], col[c], memref(ins.in[2]));
        for (int64_t l = 0; l < V; ++l) {
          std::string t = op("arith.mulf", op("arith.mulf", op("arith.subf", v[c][l], mean), inv), g[l]);
          y[c][l] = rms ? t : op("arith.addf", t, b[l]);
        }
      }
    }
    for (int64_t c = 0; c < chunks; ++c)
      line("memref.store " + packLanes(y[c], elem(ins.out[0])) + ", %out0[" + at[c] + "] : " + memref(ins.out[0]));
    line("}");
    line("gpu.return");
    os << "    }\n";
    return os.str();
  }

  /// Cross-entropy over the last axis of logits [rows, V] with integer
  /// targets (attrs "kernel", "launch"): a block of 256 threads per row, each
  /// thread an online maximum and sum of exponentials over its share of the
  /// row (vector loads), combined over the warp by shuffles and over the
  /// block through workgroup memory. The loss: each row's log-sum-exp minus
  /// its target's logit into `rowLoss` (the runtime averages them); a target
  /// outside [0, V) raises the runtime's error word (code 2, row, value).
  /// The gradient: (softmax - onehot) * dloss / rows, written V at a time.
  std::string writeCrossEntropy() {
    bool grad = ins.op == "cross_entropy_grad";
    const rt::Buffer &logits = r.buffers[ins.in[0]], &targets = r.buffers[ins.in[1]];
    int64_t vocab = logits.shape.back(), rows = count(ins.in[1]);
    V = ins.attrs.at("launch").value("vector", int64_t(1));
    std::string ty = elem(ins.in[0]), vty = "vector<" + std::to_string(V) + "x" + ty + ">";
    std::string lv = "memref<" + std::to_string(rows * vocab / V) + "x" + vty + ">";
    std::string ity = targets.dtype == LOOM_I64 ? "i64" : "i32";
    std::string tm = "memref<" + std::to_string(rows) + "x" + ity + ">";
    std::string shared = "memref<8xf32, #gpu.address_space<workgroup>>";
    os << "    gpu.func @" << ins.attrs.at("kernel").get<std::string>() << "(%lv: " << lv;
    if (grad)
      os << ", %tg: " << tm << ", %dloss: memref<1xf32>, %out: " << lv;
    else
      os << ", %ls: memref<" << rows * vocab << "x" << ty << ">, %tg: " << tm << ", %rowLoss: memref<" << rows
         << "xf32>, %err: memref<3xi64>";
    os << ") workgroup(%wm: " << shared << ", %wsum: " << shared << ") kernel {\n";
    line("%row = gpu.block_id x");
    line("%tid = gpu.thread_id x");
    line("%warp = arith.divui %tid, " + constIndex(32) + " : index");
    line("%lane = arith.remui %tid, " + constIndex(32) + " : index");
    std::string traw = tmp(), t = tmp();
    line(traw + " = memref.load %tg[%row] : " + tm);
    line(t + " = " + (ity == "i64" ? "arith.addi " + traw + ", " + constI64(0) : "arith.extsi " + traw + " : i32 to i64") +
         (ity == "i64" ? " : i64" : ""));
    line("%rowV = arith.muli %row, " + constIndex(vocab / V) + " : index");
    std::string n = constIndex(vocab / V), step = constIndex(256), ninf = constF(-INFINITY), zero = constF(0);
    // Pass 1: this thread's maximum and sum of exponentials.
    std::string m = tmp(), sum = tmp(), j = tmp(), mi = tmp(), si = tmp();
    line(m + ", " + sum + " = scf.for " + j + " = %tid to " + n + " step " + step + " iter_args(" + mi + " = " + ninf +
         ", " + si + " = " + zero + ") -> (f32, f32) {");
    {
      std::string at = tmp();
      line(at + " = arith.addi %rowV, " + j + " : index");
      std::vector<std::string> x = loadLanes("%lv", ins.in[0], at, lv);
      std::string vm = x[0];
      for (int64_t l = 1; l < V; ++l)
        vm = op("arith.maximumf", vm, x[l]);
      std::string big = op("arith.maximumf", mi, vm);
      std::string acc = op("arith.mulf", si, rescale(mi, big));
      for (int64_t l = 0; l < V; ++l)
        acc = op("arith.addf", acc, op("math.exp", op("arith.subf", x[l], big)));
      line("scf.yield " + big + ", " + acc + " : f32, f32");
    }
    line("}");
    // Over the warp, then the block's eight warps.
    auto combine = [&](std::string &ma, std::string &sa, const std::string &mb, const std::string &sb) {
      std::string big = op("arith.maximumf", ma, mb);
      sa = op("arith.addf", op("arith.mulf", sa, rescale(ma, big)), op("arith.mulf", sb, rescale(mb, big)));
      ma = big;
    };
    std::string width = tmp();
    line(width + " = arith.constant 32 : i32");
    std::string wm = m, ws = sum;
    for (int offset : {16, 8, 4, 2, 1}) {
      std::string o = tmp(), gm = tmp(), gs = tmp(), ok1 = tmp(), ok2 = tmp();
      line(o + " = arith.constant " + std::to_string(offset) + " : i32");
      line(gm + ", " + ok1 + " = gpu.shuffle xor " + wm + ", " + o + ", " + width + " : f32");
      line(gs + ", " + ok2 + " = gpu.shuffle xor " + ws + ", " + o + ", " + width + " : f32");
      combine(wm, ws, gm, gs);
    }
    std::string first = tmp();
    line(first + " = arith.cmpi eq, %lane, " + constIndex(0) + " : index");
    line("scf.if " + first + " {");
    line("memref.store " + wm + ", %wm[%warp] : " + shared);
    line("memref.store " + ws + ", %wsum[%warp] : " + shared);
    line("}");
    line("gpu.barrier");
    std::string bm = ninf, bs = zero;
    for (int w = 0; w < 8; ++w) {
      std::string c = constIndex(w), a = tmp(), b = tmp();
      line(a + " = memref.load %wm[" + c + "] : " + shared);
      line(b + " = memref.load %wsum[" + c + "] : " + shared);
      combine(bm, bs, a, b);
    }
    std::string vocabI64 = constI64(vocab);
    if (!grad) {
      std::string lead = tmp();
      line(lead + " = arith.cmpi eq, %tid, " + constIndex(0) + " : index");
      line("scf.if " + lead + " {");
      std::string neg = tmp(), over = tmp(), bad = tmp();
      line(neg + " = arith.cmpi slt, " + t + ", " + constI64(0) + " : i64");
      line(over + " = arith.cmpi sge, " + t + ", " + vocabI64 + " : i64");
      line(bad + " = arith.ori " + neg + ", " + over + " : i1");
      line("scf.if " + bad + " {");
      std::string code = constI64(2), old = tmp(), won = tmp(), rowI = tmp();
      line(old + " = memref.atomic_rmw maxs " + code + ", %err[" + constIndex(0) + "] : (i64, memref<3xi64>) -> i64");
      line(won + " = arith.cmpi eq, " + old + ", " + constI64(0) + " : i64");
      line(rowI + " = arith.index_cast %row : index to i64");
      line("scf.if " + won + " {");
      line("memref.store " + rowI + ", %err[" + constIndex(1) + "] : memref<3xi64>");
      line("memref.store " + t + ", %err[" + constIndex(2) + "] : memref<3xi64>");
      line("}");
      line("} else {");
      std::string tIndex = tmp(), base = tmp(), at = tmp(), xt = tmp();
      line(tIndex + " = arith.index_cast " + t + " : i64 to index");
      line(base + " = arith.muli %row, " + constIndex(vocab) + " : index");
      line(at + " = arith.addi " + base + ", " + tIndex + " : index");
      line(xt + " = memref.load %ls[" + at + "] : memref<" + std::to_string(rows * vocab) + "x" + ty + ">");
      std::string loss = op("arith.subf", op("arith.addf", bm, op("math.log", bs)), widen(xt, ty));
      line("memref.store " + loss + ", %rowLoss[%row] : memref<" + std::to_string(rows) + "xf32>");
      line("}");
      line("}");
    } else {
      // Pass 2: (softmax - onehot) * dloss / rows.
      std::string d = tmp();
      line(d + " = memref.load %dloss[" + constIndex(0) + "] : memref<1xf32>");
      std::string scale = op("arith.mulf", d, constF(1.0 / double(rows)));
      std::string inv = op("arith.divf", constF(1), bs);
      std::string j2 = tmp();
      line("scf.for " + j2 + " = %tid to " + n + " step " + step + " {");
      std::string at = tmp();
      line(at + " = arith.addi %rowV, " + j2 + " : index");
      std::vector<std::string> x = loadLanes("%lv", ins.in[0], at, lv);
      std::string col0 = tmp(), col0i = tmp();
      line(col0 + " = arith.muli " + j2 + ", " + constIndex(V) + " : index");
      line(col0i + " = arith.index_cast " + col0 + " : index to i64");
      std::vector<std::string> y(V);
      for (int64_t l = 0; l < V; ++l) {
        std::string col = tmp(), hit = tmp(), one = tmp();
        line(col + " = arith.addi " + col0i + ", " + constI64(l) + " : i64");
        line(hit + " = arith.cmpi eq, " + col + ", " + t + " : i64");
        line(one + " = arith.select " + hit + ", " + constF(1) + ", " + constF(0) + " : f32");
        std::string p = op("arith.mulf", op("math.exp", op("arith.subf", x[l], bm)), inv);
        y[l] = op("arith.mulf", op("arith.subf", p, one), scale);
      }
      line("memref.store " + packLanes(y, elem(ins.out[0])) + ", %out[" + at + "] : " + lv);
      line("}");
    }
    line("gpu.return");
    os << "    }\n";
    return os.str();
  }

  /// One AdamW update over a run of instructions (`members`, this one
  /// first): the tensors' element offsets in the arena and the run's chunk
  /// starts are constant tables in the module; block b finds its tensor by a
  /// binary search over the starts and updates elements [2048 c, 2048 (c + 1))
  /// of it, four at a time (16-byte vectors, bf16 gradients widened), the
  /// tail one at a time; each tensor's weight decay is a third table. The
  /// step's scalars (rate, clipping scale and the bias corrections
  /// 1 - beta^t) come from the runtime in a 4-float buffer.
  std::string writeAdam(const std::vector<const rt::Instruction *> &members) {
    std::string name = ins.attrs.at("kernel").get<std::string>();
    int64_t chunk = ins.attrs.at("launch").value("chunk", int64_t(2048));
    int64_t f32s = std::max<int64_t>(r.arenaBytes / 4, 4), halves = std::max<int64_t>(r.arenaBytes / 2, 4);
    // [p, g, m, v, n, g is bf16] in elements of each one's dtype; chunk starts.
    std::string table, starts = "0", decays;
    int64_t total = 0;
    for (const rt::Instruction *a : members) {
      std::ostringstream wd;
      wd.precision(9);
      wd << std::scientific << float(a->attrs.value("weight_decay", 0.0));
      decays += (decays.empty() ? "" : ", ") + wd.str();
      const rt::Buffer &g = r.buffers[a->in[1]];
      int64_t n = count(a->in[0]);
      bool bf = g.dtype == LOOM_BF16;
      // The bf16 copy the update writes (loom-update-copies), or -1.
      int64_t copy = a->out.size() > 3 ? r.buffers[a->out[3]].offset / 2 : -1;
      table += std::string(table.empty() ? "" : ", ") + "[" + std::to_string(r.buffers[a->in[0]].offset / 4) + ", " +
               std::to_string(g.offset / (bf ? 2 : 4)) + ", " + std::to_string(r.buffers[a->in[2]].offset / 4) + ", " +
               std::to_string(r.buffers[a->in[3]].offset / 4) + ", " + std::to_string(n) + ", " + (bf ? "1" : "0") +
               ", " + std::to_string(copy) + "]";
      total += (n + chunk - 1) / chunk;
      starts += ", " + std::to_string(total);
    }
    int64_t T = int64_t(members.size());
    std::string tt = "memref<" + std::to_string(T) + "x7xi64>", st = "memref<" + std::to_string(T + 1) + "xi64>";
    os << "    memref.global \"private\" constant @" << name << "_t : " << tt << " = dense<[" << table << "]>\n";
    os << "    memref.global \"private\" constant @" << name << "_s : " << st << " = dense<[" << starts << "]>\n";
    std::string wt = "memref<" + std::to_string(T) + "xf32>";
    os << "    memref.global \"private\" constant @" << name << "_w : " << wt << " = dense<[" << decays << "]>\n";
    std::string f = "memref<" + std::to_string(f32s) + "xf32>", f4 = "memref<" + std::to_string(f32s / 4) + "xvector<4xf32>>";
    std::string h = "memref<" + std::to_string(halves) + "xbf16>", h4 = "memref<" + std::to_string(halves / 4) + "xvector<4xbf16>>";
    os << "    gpu.func @" << name << "(%f: " << f << ", %f4: " << f4 << ", %h: " << h << ", %h4: " << h4
       << ", %sc: memref<4xf32>) kernel {\n";
    line("%bid = gpu.block_id x");
    line("%tid = gpu.thread_id x");
    line("%tab = memref.get_global @" + name + "_t : " + tt);
    line("%starts = memref.get_global @" + name + "_s : " + st);
    line("%decays = memref.get_global @" + name + "_w : " + "memref<" + std::to_string(T) + "xf32>");
    line("%b = arith.index_cast %bid : index to i64");
    std::string one = constIndex(1), lo = tmp(), l = tmp(), hi = tmp();
    line(lo + ":2 = scf.while (" + l + " = " + constIndex(0) + ", " + hi + " = " + constIndex(T) +
         ") : (index, index) -> (index, index) {");
    {
      std::string d = tmp(), go = tmp();
      line(d + " = arith.subi " + hi + ", " + l + " : index");
      line(go + " = arith.cmpi ugt, " + d + ", " + one + " : index");
      line("scf.condition(" + go + ") " + l + ", " + hi + " : index, index");
    }
    std::string l2 = tmp(), h2 = tmp();
    line("} do {");
    line("^bb0(" + l2 + ": index, " + h2 + ": index):");
    {
      std::string sum = tmp(), mid = tmp(), sv = tmp(), le = tmp(), nl = tmp(), nh = tmp();
      line(sum + " = arith.addi " + l2 + ", " + h2 + " : index");
      line(mid + " = arith.divui " + sum + ", " + constIndex(2) + " : index");
      line(sv + " = memref.load %starts[" + mid + "] : " + st);
      line(le + " = arith.cmpi sle, " + sv + ", %b : i64");
      line(nl + " = arith.select " + le + ", " + mid + ", " + l2 + " : index");
      line(nh + " = arith.select " + le + ", " + h2 + ", " + mid + " : index");
      line("scf.yield " + nl + ", " + nh + " : index, index");
    }
    line("}");
    std::string t = lo + "#0";
    auto field = [&](int k) {
      std::string v = tmp(), i = tmp();
      line(v + " = memref.load %tab[" + t + ", " + constIndex(k) + "] : " + tt);
      line(i + " = arith.index_cast " + v + " : i64 to index");
      return i;
    };
    std::string P = field(0), G = field(1), M = field(2), Vv = field(3), N = field(4), BF = tmp(), bfi = field(5);
    line(BF + " = arith.cmpi ne, " + bfi + ", " + constIndex(0) + " : index");
    std::string C = field(6), HAS = tmp();
    line(HAS + " = arith.cmpi sge, " + C + ", " + constIndex(0) + " : index");
    std::string first = tmp(), firstI = tmp(), c = tmp(), begin = tmp(), end0 = tmp(), end = tmp();
    line(first + " = memref.load %starts[" + t + "] : " + st);
    line(firstI + " = arith.index_cast " + first + " : i64 to index");
    line(c + " = arith.subi %bid, " + firstI + " : index");
    line(begin + " = arith.muli " + c + ", " + constIndex(chunk) + " : index");
    line(end0 + " = arith.addi " + begin + ", " + constIndex(chunk) + " : index");
    line(end + " = arith.minui " + end0 + ", " + N + " : index");
    auto scalar = [&](int k) {
      std::string v = tmp();
      line(v + " = memref.load %sc[" + constIndex(k) + "] : memref<4xf32>");
      return v;
    };
    std::string rate = scalar(0), scale = scalar(1), c1 = scalar(2), c2 = scalar(3);
    std::string inv1 = op("arith.divf", constF(1), c1), invSqrt2 = op("math.rsqrt", c2);
    float b1 = float(ins.attrs.value("beta1", 0.9)), b2 = float(ins.attrs.value("beta2", 0.999));
    float eps = float(ins.attrs.value("eps", 1e-8));
    std::string B1 = constF(b1), B2 = constF(b2), OB1 = constF(1.0f - b1), OB2 = constF(1.0f - b2), EPS = constF(eps),
                WD = tmp();
    line(WD + " = memref.load %decays[" + t + "] : memref<" + std::to_string(T) + "xf32>");
    // One element: returns the new p, m, v.
    auto update = [&](const std::string &p, const std::string &g, const std::string &m, const std::string &v) {
      std::string gi = op("arith.mulf", g, scale);
      std::string mi = op("arith.addf", op("arith.mulf", B1, m), op("arith.mulf", OB1, gi));
      std::string vi = op("arith.addf", op("arith.mulf", B2, v), op("arith.mulf", op("arith.mulf", OB2, gi), gi));
      std::string den = op("arith.addf", op("arith.mulf", op("math.sqrt", vi), invSqrt2), EPS);
      std::string dir = op("arith.addf", op("arith.divf", op("arith.mulf", mi, inv1), den), op("arith.mulf", WD, p));
      return std::array<std::string, 3>{op("arith.subf", p, op("arith.mulf", rate, dir)), mi, vi};
    };
    // Elements [e, e + width) of the tensor: width 4 through the vector
    // views (16-byte accesses), 1 through the scalar ones.
    auto elements = [&](int width, const std::string &e) {
      bool wide = width == 4;
      std::string fm = wide ? "%f4" : "%f", hm = wide ? "%h4" : "%h", ft = wide ? f4 : f, ht = wide ? h4 : h;
      std::string vt = wide ? "vector<4xf32>" : "f32", hvt = wide ? "vector<4xbf16>" : "bf16";
      auto at = [&](const std::string &base) {
        std::string a = tmp();
        line(a + " = arith.addi " + base + ", " + e + " : index");
        if (!wide)
          return a;
        std::string d = tmp();
        line(d + " = arith.divui " + a + ", " + constIndex(4) + " : index");
        return d;
      };
      std::string pa = at(P), ma = at(M), va = at(Vv), ga = at(G);
      auto load = [&](const std::string &memref, const std::string &index, const std::string &type) {
        std::string v = tmp();
        line(v + " = memref.load " + memref + "[" + index + "] : " + type);
        return v;
      };
      std::string pv = load(fm, pa, ft), mv = load(fm, ma, ft), vv = load(fm, va, ft), gv = tmp();
      line(gv + " = scf.if " + BF + " -> (" + vt + ") {");
      std::string raw = load(hm, ga, ht), widened = tmp();
      line(widened + " = arith.extf " + raw + " : " + hvt + " to " + vt);
      line("scf.yield " + widened + " : " + vt);
      line("} else {");
      line("scf.yield " + load(fm, ga, ft) + " : " + vt);
      line("}");
      auto lanes = [&](const std::string &vec) {
        std::vector<std::string> out;
        for (int k = 0; k < width && wide; ++k) {
          std::string x = tmp();
          line(x + " = vector.extract " + vec + "[" + std::to_string(k) + "] : f32 from vector<4xf32>");
          out.push_back(x);
        }
        return wide ? out : std::vector<std::string>{vec};
      };
      std::vector<std::string> ps = lanes(pv), gs = lanes(gv), ms = lanes(mv), vs = lanes(vv);
      std::array<std::vector<std::string>, 3> next; // p, m, v
      for (int k = 0; k < width; ++k) {
        auto u = update(ps[k], gs[k], ms[k], vs[k]);
        for (int w = 0; w < 3; ++w)
          next[w].push_back(u[w]);
      }
      for (int w = 0; w < 3; ++w)
        line("memref.store " + (wide ? packLanes(next[w], "f32") : next[w][0]) + ", " + fm + "[" +
             (w == 0 ? pa : w == 1 ? ma : va) + "] : " + ft);
      // The copy, rounded to nearest even as a cast rounds.
      line("scf.if " + HAS + " {");
      std::string ca = at(C), narrow;
      if (wide) {
        narrow = packLanes(next[0], "bf16");
      } else {
        narrow = tmp();
        line(narrow + " = arith.truncf " + next[0][0] + " : f32 to bf16");
      }
      line("memref.store " + narrow + ", " + hm + "[" + ca + "] : " + ht);
      line("}");
    };
    // Four at a time, then the tail one at a time.
    std::string span = tmp(), n4 = tmp(), q = tmp();
    line(span + " = arith.subi " + end + ", " + begin + " : index");
    line(n4 + " = arith.divui " + span + ", " + constIndex(4) + " : index");
    line("scf.for " + q + " = %tid to " + n4 + " step " + constIndex(256) + " {");
    std::string q4 = tmp(), e = tmp();
    line(q4 + " = arith.muli " + q + ", " + constIndex(4) + " : index");
    line(e + " = arith.addi " + begin + ", " + q4 + " : index");
    elements(4, e);
    line("}");
    std::string tail0 = tmp(), tailStart = tmp(), from = tmp(), i = tmp();
    line(tail0 + " = arith.muli " + n4 + ", " + constIndex(4) + " : index");
    line(tailStart + " = arith.addi " + begin + ", " + tail0 + " : index");
    line(from + " = arith.addi " + tailStart + ", %tid : index");
    line("scf.for " + i + " = " + from + " to " + end + " step " + constIndex(256) + " {");
    elements(1, i);
    line("}");
    line("gpu.return");
    os << "    }\n";
    return os.str();
  }

protected:
  /// exp(old - big), 1 where old is big (both may be -inf: an empty share).
  std::string rescale(const std::string &old, const std::string &big) {
    std::string same = tmp(), t = tmp();
    line(same + " = arith.cmpf oeq, " + old + ", " + big + " : f32");
    line(t + " = arith.select " + same + ", " + constF(1) + ", " + op("math.exp", op("arith.subf", old, big)) + " : f32");
    return t;
  }
  std::string constI64(int64_t v) {
    std::string t = tmp();
    line(t + " = arith.constant " + std::to_string(v) + " : i64");
    return t;
  }
  /// The V lanes of one vector load, widened to f32.
  std::vector<std::string> loadLanes(const std::string &arg, int64_t id, const std::string &at,
                                     const std::string &type) {
    std::string vec = tmp(), ty = elem(id);
    line(vec + " = memref.load " + arg + "[" + at + "] : " + type);
    std::vector<std::string> lanes;
    for (int64_t l = 0; l < V; ++l) {
      std::string x = tmp();
      line(x + " = vector.extract " + vec + "[" + std::to_string(l) + "] : " + ty + " from vector<" +
           std::to_string(V) + "x" + ty + ">");
      lanes.push_back(widen(x, ty));
    }
    return lanes;
  }
  /// f32 values rounded to `ty` and packed into a vector of as many lanes.
  std::string packLanes(const std::vector<std::string> &values, const std::string &ty) {
    std::string vty = "vector<" + std::to_string(values.size()) + "x" + ty + ">", vec = tmp();
    line(vec + " = arith.constant dense<0.0> : " + vty);
    for (size_t l = 0; l < values.size(); ++l) {
      std::string x = values[l];
      if (ty == "bf16") {
        std::string t = tmp();
        line(t + " = arith.truncf " + x + " : f32 to bf16");
        x = t;
      }
      std::string next = tmp();
      line(next + " = vector.insert " + x + ", " + vec + "[" + std::to_string(l) + "] : " + ty + " into " + vty);
      vec = next;
    }
    return vec;
  }
  /// `combine` over the 32 lanes of the warp (butterfly shuffles: every lane gets it).
  std::string warpReduce(std::string v, const char *combine) {
    std::string width = tmp();
    line(width + " = arith.constant 32 : i32");
    for (int offset : {16, 8, 4, 2, 1}) {
      std::string o = tmp(), got = tmp(), valid = tmp();
      line(o + " = arith.constant " + std::to_string(offset) + " : i32");
      line(got + ", " + valid + " = gpu.shuffle xor " + v + ", " + o + ", " + width + " : f32");
      v = op(combine, v, got);
    }
    return v;
  }
  int64_t count(int64_t id) const { return rt::numElements(r.buffers[id].shape).value_or(0); }
  std::string elem(int64_t id) const { return r.buffers[id].dtype == LOOM_BF16 ? "bf16" : "f32"; }
  std::string widen(const std::string &x, const std::string &ty) {
    if (ty == "f32")
      return x;
    std::string t = tmp();
    line(t + " = arith.extf " + x + " : " + ty + " to f32");
    return t;
  }
  /// The index into input `id` (broadcast to `shape`) of output element `e`:
  /// the sum over the axes it keeps of the element's digit times the stride.
  std::string inputIndex(int64_t id, const rt::Shape &shape, const std::string &e) {
    const rt::Shape &in = r.buffers[id].shape;
    if (in == shape)
      return e;
    std::vector<int64_t> outStrides(shape.size(), 1), inStrides(in.size(), 1);
    for (int d = int(shape.size()) - 2; d >= 0; --d)
      outStrides[d] = outStrides[d + 1] * shape[d + 1];
    for (int d = int(in.size()) - 2; d >= 0; --d)
      inStrides[d] = inStrides[d + 1] * in[d + 1];
    size_t off = shape.size() - in.size();
    std::string acc;
    for (size_t d = off; d < shape.size(); ++d) {
      if (in[d - off] == 1 && shape[d] != 1)
        continue;
      std::string digit = tmp(), q = tmp();
      line(q + " = arith.divui " + e + ", " + constIndex(outStrides[d]) + " : index");
      line(digit + " = arith.remui " + q + ", " + constIndex(shape[d]) + " : index");
      std::string term = tmp();
      line(term + " = arith.muli " + digit + ", " + constIndex(inStrides[d - off]) + " : index");
      if (acc.empty()) {
        acc = term;
      } else {
        std::string sum = tmp();
        line(sum + " = arith.addi " + acc + ", " + term + " : index");
        acc = sum;
      }
    }
    return acc.empty() ? constIndex(0) : acc;
  }
  void line(const std::string &s) { os << "      " << s << "\n"; }
  std::string tmp() { return "%t" + std::to_string(counter++); }
  std::string constIndex(int64_t v) {
    std::string t = tmp();
    line(t + " = arith.constant " + std::to_string(v) + " : index");
    return t;
  }
  std::string constF(double v) {
    std::string t = tmp();
    std::ostringstream s;
    s.precision(9);
    s << std::scientific << v;
    line(t + " = arith.constant " + (std::isinf(v) ? (v < 0 ? "0xFF800000" : "0x7F800000") : s.str()) + " : f32");
    return t;
  }
  std::string op(const std::string &name, const std::string &a, const std::string &b = "") {
    std::string t = tmp();
    line(t + " = " + name + " " + a + (b.empty() ? "" : ", " + b) + " : f32");
    return t;
  }
  std::string tanh(const std::string &x) { return op("math.tanh", x); }
  std::string sigmoid(const std::string &x) {
    return op("arith.divf", constF(1), op("arith.addf", constF(1), op("math.exp", op("arith.negf", x))));
  }
  std::string geluTanhInner(const std::string &x) { // tanh(k (x + a x^3))
    std::string x3 = op("arith.mulf", op("arith.mulf", x, x), x);
    std::string inner = op("arith.addf", x, op("arith.mulf", constF(0.044715), x3));
    return tanh(op("arith.mulf", constF(0.79788456080286536), inner));
  }
  std::string emitStep(const json &step, const std::vector<std::string> &a) {
    std::string kind = step.at("op");
    if (kind == "add") return op("arith.addf", a[0], a[1]);
    if (kind == "sub") return op("arith.subf", a[0], a[1]);
    if (kind == "mul") return op("arith.mulf", a[0], a[1]);
    if (kind == "div") return op("arith.divf", a[0], a[1]);
    if (kind == "neg") return op("arith.negf", a[0]);
    if (kind == "scale") return op("arith.mulf", a[0], constF(step.value("factor", 1.0)));
    if (kind == "exp") return op("math.exp", a[0]);
    if (kind == "tanh") return tanh(a[0]);
    if (kind == "rsqrt") return op("math.rsqrt", a[0]);
    if (kind == "relu") {
      std::string positive = tmp();
      line(positive + " = arith.cmpf ogt, " + a[0] + ", " + constF(0) + " : f32");
      std::string t = tmp();
      line(t + " = arith.select " + positive + ", " + a[0] + ", " + constF(0) + " : f32");
      return t;
    }
    if (kind == "silu") return op("arith.mulf", a[0], sigmoid(a[0]));
    if (kind == "gelu") {
      std::string half = op("arith.mulf", constF(0.5), a[0]);
      std::string t = step.value("approximate", false)
                          ? geluTanhInner(a[0])
                          : op("math.erf", op("arith.mulf", a[0], constF(0.70710678118654752)));
      return op("arith.mulf", half, op("arith.addf", constF(1), t));
    }
    // unary_grad(x, y, dy) = dy * f'(x)
    std::string fn = step.value("fn", std::string()), x = a[0], y = a[1], d;
    if (fn == "gelu") {
      std::string cdf = op("arith.mulf", constF(0.5),
                           op("arith.addf", constF(1), op("math.erf", op("arith.mulf", x, constF(0.70710678118654752)))));
      std::string pdf = op("math.exp", op("arith.mulf", constF(-0.5), op("arith.mulf", x, x)));
      d = op("arith.addf", cdf, op("arith.mulf", op("arith.mulf", x, constF(0.39894228040143268)), pdf));
    } else if (fn == "gelu_tanh") {
      std::string t = geluTanhInner(x);
      std::string left = op("arith.mulf", constF(0.5), op("arith.addf", constF(1), t));
      std::string sech2 = op("arith.subf", constF(1), op("arith.mulf", t, t));
      std::string poly = op("arith.addf", constF(1), op("arith.mulf", constF(3 * 0.044715), op("arith.mulf", x, x)));
      std::string right = op("arith.mulf", op("arith.mulf", op("arith.mulf", constF(0.5), x), sech2),
                             op("arith.mulf", constF(0.79788456080286536), poly));
      d = op("arith.addf", left, right);
    } else if (fn == "silu") {
      std::string s = sigmoid(x);
      d = op("arith.mulf", s, op("arith.addf", constF(1), op("arith.mulf", x, op("arith.subf", constF(1), s))));
    } else if (fn == "relu") {
      std::string positive = tmp();
      line(positive + " = arith.cmpf ogt, " + x + ", " + constF(0) + " : f32");
      d = tmp();
      line(d + " = arith.select " + positive + ", " + constF(1) + ", " + constF(0) + " : f32");
    } else if (fn == "tanh") {
      d = op("arith.subf", constF(1), op("arith.mulf", y, y));
    } else if (fn == "exp") {
      d = y;
    } else { // rsqrt
      d = op("arith.mulf", constF(-0.5), op("arith.mulf", op("arith.mulf", y, y), y));
    }
    return op("arith.mulf", a[2], d);
  }

  const rt::RankProgram &r;
  const rt::Instruction &ins;
  std::ostringstream os;
  int counter = 0;
  int64_t V = 1; // elements per thread
};

} // namespace

FailureOr<std::string> mlir::loom::fusedKernelsPtx(const std::vector<rt::RankProgram> &ranks,
                                                   std::string &error) {
  std::string text = "module attributes {gpu.container_module} {\n"
                     "  gpu.module @loom_kernels [#nvvm.target<chip = \"sm_90a\", features = \"+ptx80\">] {\n";
  int kernels = 0;
  std::set<std::string> written; // instructions of one shape share their row kernel
  // A generated kernel's name is a string; pooling's "kernel" is its window.
  auto generated = [](const rt::Instruction &ins) {
    return ins.attrs.is_object() && ins.attrs.contains("kernel") && ins.attrs["kernel"].is_string()
               ? ins.attrs["kernel"].get<std::string>()
               : std::string();
  };
  for (const rt::RankProgram &rank : ranks)
    for (const auto &[name, list] : rank.programs)
      for (size_t i = 0; i < list.size(); ++i) {
        const rt::Instruction &ins = list[i];
        if (!generated(ins).empty() && !written.insert(generated(ins)).second)
          continue;
        if (ins.op == "adamw") { // the run of instructions that names this kernel
          std::vector<const rt::Instruction *> members;
          for (size_t j = i; j < list.size() && generated(list[j]) == generated(ins); ++j)
            members.push_back(&list[j]);
          text += KernelWriter(rank, ins).writeAdam(members);
          ++kernels;
        } else if (ins.op == "fused") {
          text += KernelWriter(rank, ins).write();
          ++kernels;
        } else if (!generated(ins).empty()) {
          text += ins.op.rfind("cross_entropy", 0) == 0 ? KernelWriter(rank, ins).writeCrossEntropy()
                                                        : KernelWriter(rank, ins).writeRows();
          ++kernels;
        }
      }
  text += "  }\n}\n";
  if (kernels == 0)
    return std::string();
  // Its own context with every dialect, extension and translation the
  // gpu -> NVVM -> PTX pipeline needs.
  static std::once_flag passes;
  std::call_once(passes, [] { registerAllPasses(); });
  DialectRegistry registry;
  registerAllDialects(registry);
  registerAllExtensions(registry);
  registerAllToLLVMIRTranslations(registry);
  MLIRContext context(registry);
  context.loadAllAvailableDialects();
  std::string diagnostics;
  llvm::raw_string_ostream diag(diagnostics);
  ScopedDiagnosticHandler handler(&context, [&](Diagnostic &d) {
    diag << d << "\n";
    return success();
  });
  OwningOpRef<ModuleOp> module = parseSourceString<ModuleOp>(text, &context);
  if (!module) {
    error = "internal error: the generated kernels do not parse: " + diagnostics;
    return failure();
  }
  PassManager pm(&context);
  if (failed(parsePassPipeline("gpu.module(convert-scf-to-cf,convert-gpu-to-nvvm{"
                               "index-bitwidth=64 use-bare-ptr-memref-call-conv=1},canonicalize),"
                               "gpu-module-to-binary{format=isa}",
                               pm))) {
    error = "internal error: the gpu pipeline does not parse";
    return failure();
  }
  if (failed(pm.run(*module))) {
    error = "generating PTX failed: " + diagnostics;
    return failure();
  }
  for (auto binary : module->getOps<gpu::BinaryOp>())
    for (Attribute a : binary.getObjects())
      if (auto object = dyn_cast<gpu::ObjectAttr>(a))
        return object.getObject().getValue().str();
  std::string dump;
  llvm::raw_string_ostream os(dump);
  module->print(os);
  error = "internal error: no PTX came out of the gpu pipeline: " + dump.substr(0, 2000);
  return failure();
}
