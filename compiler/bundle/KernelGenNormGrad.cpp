//===- KernelGenNormGrad.cpp - The generated norm gradient ----------------===//
//
// layernorm_grad and rmsnorm_grad (x, gamma, dy[, r]) -> dx, dgamma(, dbeta)
// as two generated kernels. The first gives each warp of a block rows of the
// block's run in registers (a lane its h / 32 elements, loaded V at a time):
// dx as the CPU backend computes it (plus the residual stream's gradient r
// where the instruction has it), and the row's dy * x-hat and dy added into
// the warp's own accumulators in workgroup memory (each lane its own
// columns: no atomics, no barrier until the end); the block adds its warps'
// accumulators in order into its row of a partial table in the runtime's
// workspace. The second ("<kernel>_sum") adds the blocks' rows column by
// column in a fixed order, so the parameters' gradients are the same in
// every run.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/KernelWriter.h"

namespace mlir::loom::kernelgen {

std::string KernelWriter::writeNormGrad() {
  bool rms = ins.op == "rmsnorm_grad", residual = ins.in.size() == 4;
  const rt::Buffer &x = r.buffers[ins.in[0]];
  const json &launch = ins.attrs.at("launch");
  int64_t h = x.shape.back(), rows = count(ins.in[0]) / h;
  V = launch.value("vector", int64_t(1));
  int64_t warps = launch.value("block", int64_t(32)) / 32, perBlock = launch.value("rows", int64_t(1));
  int64_t grid = launch.value("grid", int64_t(1)), chunks = h / (32 * V);
  // Accumulators are A-wide f32 vectors (16 bytes where V allows); W columns
  // a warp: dy * x-hat, then dy (LayerNorm only).
  int64_t A = std::min<int64_t>(V, 4), W = (rms ? 1 : 2) * h;
  std::string av = "vector<" + std::to_string(A) + "xf32>", acc = workgroup(warps * W / A, av);
  std::string part = "memref<" + std::to_string(grid * W / A) + "x" + av + ">";
  auto vtype = [&](int64_t id) { return "vector<" + std::to_string(V) + "x" + elem(id) + ">"; };
  auto memref = [&](int64_t id) { return "memref<" + std::to_string(count(id) / V) + "x" + vtype(id) + ">"; };
  std::string name = ins.attrs.at("kernel").get<std::string>();
  os << "    gpu.func @" << name << "(";
  for (size_t k = 0; k < ins.in.size(); ++k)
    os << (k ? ", " : "") << "%in" << k << ": " << memref(ins.in[k]);
  os << ", %out0: " << memref(ins.out[0]) << ", %part: " << part << ") workgroup(%acc: " << acc << ") kernel {\n";
  line("%bid = gpu.block_id x");
  line("%tid = gpu.thread_id x");
  line("%warp = arith.divui %tid, " + constIndex(32) + " : index");
  line("%lane = arith.remui %tid, " + constIndex(32) + " : index");
  line("%r0 = arith.muli %bid, " + constIndex(perBlock) + " : index");
  line("%r1a = arith.addi %r0, " + constIndex(perBlock) + " : index");
  line("%r1 = arith.minui %r1a, " + constIndex(rows) + " : index");
  line("%first = arith.addi %r0, %warp : index");
  line("%wbase = arith.muli %warp, " + constIndex(W / A) + " : index");
  // The accumulator slots of this lane: chunk c, A-vector s of its V columns.
  std::vector<std::vector<std::string>> slot(chunks, std::vector<std::string>(V / A));
  for (int64_t c = 0; c < chunks; ++c) {
    std::string colV = tmp(), colA = tmp();
    line(colV + " = arith.addi %lane, " + constIndex(32 * c) + " : index");
    line(colA + " = arith.muli " + colV + ", " + constIndex(V / A) + " : index");
    for (int64_t s = 0; s < V / A; ++s) {
      std::string t = tmp(), at = tmp();
      line(t + " = arith.addi " + colA + ", " + constIndex(s) + " : index");
      line(at + " = arith.addi %wbase, " + t + " : index");
      slot[c][s] = at;
    }
  }
  std::string zero = tmp(), hA = constIndex(h / A);
  line(zero + " = arith.constant dense<0.0> : " + av);
  auto dbSlot = [&](const std::string &at) {
    std::string t = tmp();
    line(t + " = arith.addi " + at + ", " + hA + " : index");
    return t;
  };
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t s = 0; s < V / A; ++s) {
      line("memref.store " + zero + ", %acc[" + slot[c][s] + "] : " + acc);
      if (!rms)
        line("memref.store " + zero + ", %acc[" + dbSlot(slot[c][s]) + "] : " + acc);
    }
  std::string row = tmp();
  line("scf.for " + row + " = %first to %r1 step " + constIndex(warps) + " {");
  std::string rowBase = tmp();
  line(rowBase + " = arith.muli " + row + ", " + constIndex(h / V) + " : index");
  std::vector<std::string> col(chunks), at(chunks);
  std::vector<std::vector<std::string>> xv(chunks), dv(chunks), xh(chunks, std::vector<std::string>(V)),
      dg(chunks, std::vector<std::string>(V));
  for (int64_t c = 0; c < chunks; ++c) {
    col[c] = tmp(), at[c] = tmp();
    line(col[c] + " = arith.addi %lane, " + constIndex(32 * c) + " : index");
    line(at[c] + " = arith.addi " + rowBase + ", " + col[c] + " : index");
    xv[c] = loadLanes("%in0", ins.in[0], at[c], memref(ins.in[0]));
    dv[c] = loadLanes("%in2", ins.in[2], at[c], memref(ins.in[2]));
  }
  // The row's moments, two passes over the registers as the CPU computes them.
  std::string mean = constF(0), inv = constF(1.0 / double(h));
  if (!rms) {
    std::string sum = constF(0);
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t l = 0; l < V; ++l)
        sum = op("arith.addf", sum, xv[c][l]);
    mean = op("arith.mulf", warpReduce(sum, "arith.addf"), inv);
  }
  std::string sq = constF(0);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t l = 0; l < V; ++l) {
      std::string d = op("arith.subf", xv[c][l], mean);
      sq = op("arith.addf", sq, op("arith.mulf", d, d));
    }
  std::string var = op("arith.mulf", warpReduce(sq, "arith.addf"), inv);
  std::string rstd = op("math.rsqrt", op("arith.addf", var, constF(ins.attrs.value("eps", 1e-5))));
  // x-hat, dy * gamma and the two means dx subtracts.
  std::string sd = constF(0), sdx = constF(0);
  for (int64_t c = 0; c < chunks; ++c) {
    std::vector<std::string> g = loadLanes("%in1", ins.in[1], col[c], memref(ins.in[1]));
    for (int64_t l = 0; l < V; ++l) {
      xh[c][l] = op("arith.mulf", op("arith.subf", xv[c][l], mean), rstd);
      dg[c][l] = op("arith.mulf", dv[c][l], g[l]);
      sd = op("arith.addf", sd, dg[c][l]);
      sdx = op("arith.addf", sdx, op("arith.mulf", dg[c][l], xh[c][l]));
    }
  }
  sd = rms ? constF(0) : op("arith.mulf", warpReduce(sd, "arith.addf"), inv);
  sdx = op("arith.mulf", warpReduce(sdx, "arith.addf"), inv);
  for (int64_t c = 0; c < chunks; ++c) {
    // The residual stream's gradient may be dx's own buffer: each lane reads
    // its elements of it just before it writes them.
    std::vector<std::string> res;
    if (residual)
      res = loadLanes("%in3", ins.in[3], at[c], memref(ins.in[3]));
    std::vector<std::string> o(V);
    for (int64_t l = 0; l < V; ++l) {
      std::string t = op("arith.subf", op("arith.subf", dg[c][l], sd), op("arith.mulf", xh[c][l], sdx));
      o[l] = op("arith.mulf", rstd, t);
      if (residual)
        o[l] = op("arith.addf", o[l], res[l]);
    }
    line("memref.store " + packLanes(o, elem(ins.out[0])) + ", %out0[" + at[c] + "] : " + memref(ins.out[0]));
  }
  // The parameters' gradients: dy * x-hat and dy into the warp's accumulators.
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t s = 0; s < V / A; ++s) {
      std::vector<std::string> gx, gb;
      for (int64_t l = s * A; l < (s + 1) * A; ++l)
        gx.push_back(op("arith.mulf", dv[c][l], xh[c][l])), gb.push_back(dv[c][l]);
      auto add = [&](const std::string &where, const std::vector<std::string> &values) {
        std::string old = tmp(), sum = tmp();
        line(old + " = memref.load %acc[" + where + "] : " + acc);
        line(sum + " = arith.addf " + old + ", " + packLanes(values, "f32") + " : " + av);
        line("memref.store " + sum + ", %acc[" + where + "] : " + acc);
      };
      add(slot[c][s], gx);
      if (!rms)
        add(dbSlot(slot[c][s]), gb);
    }
  line("}");
  // The block's warps in order into its row of the partial table.
  line("gpu.barrier");
  std::string q = tmp();
  line("scf.for " + q + " = %tid to " + constIndex(W / A) + " step " + constIndex(32 * warps) + " {");
  std::string sum = zero;
  for (int64_t w = 0; w < warps; ++w) {
    std::string where = tmp(), v = tmp(), next = tmp();
    line(where + " = arith.addi " + q + ", " + constIndex(w * W / A) + " : index");
    line(v + " = memref.load %acc[" + where + "] : " + acc);
    line(next + " = arith.addf " + sum + ", " + v + " : " + av);
    sum = next;
  }
  std::string blockRow = tmp(), dest = tmp();
  line(blockRow + " = arith.muli %bid, " + constIndex(W / A) + " : index");
  line(dest + " = arith.addi " + blockRow + ", " + q + " : index");
  line("memref.store " + sum + ", %part[" + dest + "] : " + part);
  line("}");
  line("gpu.return");
  os << "    }\n";

  // The column sums: a block of 32 x 32 threads per 32 columns of the table,
  // each thread a strided share of the blocks' rows, then a thread per column
  // over the 32 shares in order.
  counter = 0;
  std::string table = "memref<" + std::to_string(grid * W) + "xf32>", tile = workgroup(32 * 33, "f32");
  auto param = [&](int64_t id) { return "memref<" + std::to_string(h) + "x" + elem(id) + ">"; };
  os << "    gpu.func @" << name << "_sum(%part: " << table << ", %dg: " << param(ins.out[1]);
  if (!rms)
    os << ", %db: " << param(ins.out[2]);
  os << ") workgroup(%tile: " << tile << ") kernel {\n";
  line("%bid = gpu.block_id x");
  line("%tid = gpu.thread_id x");
  line("%tx = arith.remui %tid, " + constIndex(32) + " : index");
  line("%ty = arith.divui %tid, " + constIndex(32) + " : index");
  line("%c0 = arith.muli %bid, " + constIndex(32) + " : index");
  line("%c = arith.addi %c0, %tx : index");
  line("%inside = arith.cmpi ult, %c, " + constIndex(W) + " : index");
  std::string share = tmp(), k = tmp(), acc0 = tmp(), f0 = constF(0);
  line(share + " = scf.if %inside -> (f32) {");
  std::string s = tmp();
  line(s + " = scf.for " + k + " = %ty to " + constIndex(grid) + " step " + constIndex(32) + " iter_args(" + acc0 +
       " = " + f0 + ") -> (f32) {");
  std::string base = tmp(), idx = tmp(), v = tmp();
  line(base + " = arith.muli " + k + ", " + constIndex(W) + " : index");
  line(idx + " = arith.addi " + base + ", %c : index");
  line(v + " = memref.load %part[" + idx + "] : " + table);
  line("scf.yield " + op("arith.addf", acc0, v) + " : f32");
  line("}");
  line("scf.yield " + s + " : f32");
  line("} else {");
  line("scf.yield " + f0 + " : f32");
  line("}");
  std::string tyRow = tmp(), mine = tmp();
  line(tyRow + " = arith.muli %ty, " + constIndex(33) + " : index");
  line(mine + " = arith.addi " + tyRow + ", %tx : index");
  line("memref.store " + share + ", %tile[" + mine + "] : " + tile);
  line("gpu.barrier");
  std::string lead = tmp(), write = tmp();
  line(lead + " = arith.cmpi eq, %ty, " + constIndex(0) + " : index");
  line(write + " = arith.andi " + lead + ", %inside : i1");
  line("scf.if " + write + " {");
  std::string total = constF(0);
  for (int y = 0; y < 32; ++y) {
    std::string where = tmp(), t = tmp();
    line(where + " = arith.addi %tx, " + constIndex(33 * y) + " : index");
    line(t + " = memref.load %tile[" + where + "] : " + tile);
    total = op("arith.addf", total, t);
  }
  auto store = [&](const std::string &arg, int64_t id, const std::string &index) {
    std::string value = total;
    if (elem(id) == "bf16") {
      value = tmp();
      line(value + " = arith.truncf " + total + " : f32 to bf16");
    }
    line("memref.store " + value + ", " + arg + "[" + index + "] : " + param(id));
  };
  if (rms) {
    store("%dg", ins.out[1], "%c");
  } else {
    std::string isG = tmp();
    line(isG + " = arith.cmpi ult, %c, " + constIndex(h) + " : index");
    line("scf.if " + isG + " {");
    store("%dg", ins.out[1], "%c");
    line("} else {");
    std::string cb = tmp();
    line(cb + " = arith.subi %c, " + constIndex(h) + " : index");
    store("%db", ins.out[2], cb);
    line("}");
  }
  line("}");
  line("gpu.return");
  os << "    }\n";
  return os.str();
}

} // namespace mlir::loom::kernelgen
