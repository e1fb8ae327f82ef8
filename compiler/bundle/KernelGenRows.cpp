//===- KernelGenRows.cpp - Generated norm, softmax and loss kernels --------===//
//
// Row kernels: a norm or softmax over the last axis (a warp per row) and the
// cross-entropy loss and its gradient (a block per row).
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/KernelWriter.h"

namespace mlir::loom::kernelgen {

/// A norm or softmax over the last axis (attrs "kernel", "launch"): a warp
/// per row, eight rows per block of 256 threads, each lane holding its
/// h / 32 elements in registers as f32 (loaded and stored V at a time),
/// sums and maxima over the row by warp shuffles; two passes over the
/// registers for the variance, as the CPU backend computes it.
std::string KernelWriter::writeRows() {
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
std::string KernelWriter::writeCrossEntropy() {
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
    raiseBadTarget(t);
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
    softmaxMinusOnehot(vocab, lv, bm, inv, t, scale, ins.out[0]);
  }
  line("gpu.return");
  os << "    }\n";
  return os.str();
}

} // namespace mlir::loom::kernelgen
