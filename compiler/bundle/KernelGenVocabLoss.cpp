//===- KernelGenVocabLoss.cpp - The vocabulary-parallel loss's kernels ----===//
//
// cross_entropy and cross_entropy_grad over logits whose vocabulary is split
// over a group of ranks (`vocab_group`, tensor parallelism): the runtime runs
// these kernels around its two all-reduces over the group. A block of 256
// threads per row, V elements a load:
//
//   <kernel>_max   each row's maximum of this rank's logits;
//   <kernel>_sum   (after the maximum's all-reduce) each row's sum of
//                  exp(l - max) and its target's logit where this rank holds
//                  it (0 elsewhere); a target outside the whole vocabulary
//                  raises the runtime's error word (code 2, row, value);
//   <kernel>_grad  (after the sums' all-reduce) (softmax - onehot) * scale,
//                  scale dloss / rows, or for the loss that writes its
//                  gradient over the logits grad_scale / rows.
//
// This rank's columns start at launch.start of launch.full; the loss's rows
// (log-sum-exp minus the target's logit) and their mean stay the runtime's.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/KernelWriter.h"

namespace mlir::loom::kernelgen {

std::string KernelWriter::writeVocabLoss() {
  bool grad = ins.op == "cross_entropy_grad", fused = ins.op == "cross_entropy" && ins.out.size() == 2;
  const rt::Buffer &logits = r.buffers[ins.in[0]], &targets = r.buffers[ins.in[1]];
  const json &launch = ins.attrs.at("launch");
  int64_t vocab = logits.shape.back(), rows = count(ins.in[1]);
  int64_t start = launch.value("start", int64_t(0)), full = launch.value("full", vocab);
  V = launch.value("vector", int64_t(1));
  std::string name = ins.attrs.at("kernel").get<std::string>();
  std::string ty = elem(ins.in[0]), vty = "vector<" + std::to_string(V) + "x" + ty + ">";
  std::string lv = "memref<" + std::to_string(rows * vocab / V) + "x" + vty + ">";
  std::string ls = "memref<" + std::to_string(rows * vocab) + "x" + ty + ">";
  std::string ity = targets.dtype == LOOM_I64 ? "i64" : "i32";
  std::string tm = "memref<" + std::to_string(rows) + "x" + ity + ">";
  std::string rm = "memref<" + std::to_string(rows) + "xf32>", sm = "memref<" + std::to_string(2 * rows) + "xf32>";
  std::string shared = workgroup(8, "f32");
  auto begin = [&]() {
    counter = 0;
    line("%row = gpu.block_id x");
    line("%tid = gpu.thread_id x");
    line("%warp = arith.divui %tid, " + constIndex(32) + " : index");
    line("%lane = arith.remui %tid, " + constIndex(32) + " : index");
    line("%rowV = arith.muli %row, " + constIndex(vocab / V) + " : index");
  };
  auto target = [&]() { // the row's target as i64
    std::string raw = tmp(), t = tmp();
    line(raw + " = memref.load %tg[%row] : " + tm);
    if (ity == "i64")
      line(t + " = arith.addi " + raw + ", " + constI64(0) + " : i64");
    else
      line(t + " = arith.extsi " + raw + " : i32 to i64");
    return t;
  };
  // This thread's `combine` of f(x) over its strided share of the row's vectors.
  auto share = [&](const char *combine, const std::string &init, auto &&f) {
    std::string acc = tmp(), j = tmp(), a = tmp();
    line(acc + " = scf.for " + j + " = %tid to " + constIndex(vocab / V) + " step " + constIndex(256) + " iter_args(" +
         a + " = " + init + ") -> (f32) {");
    std::string at = tmp();
    line(at + " = arith.addi %rowV, " + j + " : index");
    std::vector<std::string> x = loadLanes("%lv", ins.in[0], at, lv);
    std::string v = a;
    for (int64_t l = 0; l < V; ++l)
      v = op(combine, v, f(x[l]));
    line("scf.yield " + v + " : f32");
    line("}");
    return acc;
  };
  // Over the block: the warp by shuffles, then the 8 warps' values in order.
  auto block = [&](std::string v, const char *combine, const std::string &buffer, const std::string &init) {
    v = warpReduce(v, combine);
    std::string first = tmp();
    line(first + " = arith.cmpi eq, %lane, " + constIndex(0) + " : index");
    line("scf.if " + first + " {");
    line("memref.store " + v + ", " + buffer + "[%warp] : " + shared);
    line("}");
    line("gpu.barrier");
    std::string total = init;
    for (int w = 0; w < 8; ++w) {
      std::string x = tmp();
      line(x + " = memref.load " + buffer + "[" + constIndex(w) + "] : " + shared);
      total = op(combine, total, x);
    }
    return total;
  };
  auto lead = [&]() {
    std::string is = tmp();
    line(is + " = arith.cmpi eq, %tid, " + constIndex(0) + " : index");
    return is;
  };
  auto same = [](const std::string &x) { return x; };

  // The row maxima.
  os << "    gpu.func @" << name << "_max(%lv: " << lv << ", %rowMax: " << rm << ") workgroup(%wm: " << shared
     << ") kernel {\n";
  begin();
  std::string ninf = constF(-INFINITY);
  std::string mx = block(share("arith.maximumf", ninf, same), "arith.maximumf", "%wm", ninf);
  line("scf.if " + lead() + " {");
  line("memref.store " + mx + ", %rowMax[%row] : " + rm);
  line("}");
  line("gpu.return");
  os << "    }\n";

  // The sums of exponentials and the targets' logits.
  os << "    gpu.func @" << name << "_sum(%lv: " << lv << ", %ls: " << ls << ", %tg: " << tm << ", %rowMax: " << rm
     << ", %stats: " << sm << ", %err: memref<3xi64>) workgroup(%ws: " << shared << ") kernel {\n";
  begin();
  std::string m = tmp();
  line(m + " = memref.load %rowMax[%row] : " + rm);
  std::string zero = constF(0);
  std::string sum =
      block(share("arith.addf", zero, [&](const std::string &x) { return op("math.exp", op("arith.subf", x, m)); }),
            "arith.addf", "%ws", zero);
  line("scf.if " + lead() + " {");
  std::string t = target(), neg = tmp(), over = tmp(), bad = tmp();
  line(neg + " = arith.cmpi slt, " + t + ", " + constI64(0) + " : i64");
  line(over + " = arith.cmpi sge, " + t + ", " + constI64(full) + " : i64");
  line(bad + " = arith.ori " + neg + ", " + over + " : i1");
  line("scf.if " + bad + " {");
  raiseBadTarget(t);
  line("} else {");
  std::string local = tmp(), from = tmp(), below = tmp(), mine = tmp(), picked = tmp();
  line(local + " = arith.subi " + t + ", " + constI64(start) + " : i64");
  line(from + " = arith.cmpi sge, " + local + ", " + constI64(0) + " : i64");
  line(below + " = arith.cmpi slt, " + local + ", " + constI64(vocab) + " : i64");
  line(mine + " = arith.andi " + from + ", " + below + " : i1");
  line(picked + " = scf.if " + mine + " -> (f32) {");
  std::string li = tmp(), base = tmp(), at = tmp(), x = tmp();
  line(li + " = arith.index_cast " + local + " : i64 to index");
  line(base + " = arith.muli %row, " + constIndex(vocab) + " : index");
  line(at + " = arith.addi " + base + ", " + li + " : index");
  line(x + " = memref.load %ls[" + at + "] : " + ls);
  line("scf.yield " + widen(x, ty) + " : f32");
  line("} else {");
  line("scf.yield " + zero + " : f32");
  line("}");
  std::string second = tmp();
  line(second + " = arith.addi %row, " + constIndex(rows) + " : index");
  line("memref.store " + sum + ", %stats[%row] : " + sm);
  line("memref.store " + picked + ", %stats[" + second + "] : " + sm);
  line("}");
  line("}");
  line("gpu.return");
  os << "    }\n";

  if (!grad && !fused)
    return os.str();
  // The gradient: (softmax - onehot) * scale, V at a time (over the logits
  // themselves for the fused loss: each thread reads its elements first).
  os << "    gpu.func @" << name << "_grad(%lv: " << lv << ", %tg: " << tm << ", %rowMax: " << rm << ", %stats: " << sm;
  if (grad)
    os << ", %dloss: memref<1xf32>";
  os << ", %out: " << lv << ") kernel {\n";
  begin();
  std::string scale;
  if (grad) {
    std::string d = tmp();
    line(d + " = memref.load %dloss[" + constIndex(0) + "] : memref<1xf32>");
    scale = op("arith.mulf", d, constF(1.0 / double(rows)));
  } else {
    scale = constF(double(float(ins.attrs.value("grad_scale", 1.0))) / double(rows));
  }
  std::string m2 = tmp(), s2 = tmp();
  line(m2 + " = memref.load %rowMax[%row] : " + rm);
  line(s2 + " = memref.load %stats[%row] : " + sm);
  std::string inv = op("arith.divf", constF(1), s2);
  std::string tl = tmp();
  line(tl + " = arith.subi " + target() + ", " + constI64(start) + " : i64");
  softmaxMinusOnehot(vocab, lv, m2, inv, tl, scale, ins.out.back());
  line("gpu.return");
  os << "    }\n";
  return os.str();
}

} // namespace mlir::loom::kernelgen
