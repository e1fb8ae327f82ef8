//===- KernelGenAdam.cpp - The generated AdamW update -----------------------===//
//
// One kernel per run of AdamW instructions, the tensors addressed by their
// arena offsets in constant tables.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/KernelWriter.h"

#include <array>

namespace mlir::loom::kernelgen {

/// One AdamW update over a run of instructions (`members`, this one
/// first): the tensors' element offsets in the arena and the run's chunk
/// starts are constant tables in the module; block b finds its tensor by a
/// binary search over the starts and updates elements [2048 c, 2048 (c + 1))
/// of it, four at a time (16-byte vectors, bf16 gradients widened), the
/// tail one at a time; each tensor's weight decay is a third table. The
/// step's scalars (rate, clipping scale and the bias corrections
/// 1 - beta^t) come from the runtime in a 4-float buffer.
std::string KernelWriter::writeAdam(const std::vector<const rt::Instruction *> &members) {
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

} // namespace mlir::loom::kernelgen
