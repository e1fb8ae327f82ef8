//===- KernelGen.cpp - GPU kernels generated through MLIR's gpu dialect ---===//
//
// The PTX of every kernel the fusion rewrites name (passes/Fusion.cpp):
// each is written as a gpu.func in MLIR's textual form (arith, math, memref,
// vector, scf and gpu ops) and lowered with convert-gpu-to-nvvm and
// gpu-module-to-binary, so the compile host needs no CUDA toolkit.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/KernelGen.h"
#include "compiler/bundle/KernelWriter.h"
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
using namespace mlir::loom::kernelgen;

namespace mlir::loom::kernelgen {

std::string KernelWriter::write() {
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

/// The index into input `id` (broadcast to `shape`) of output element `e`:
/// the sum over the axes it keeps of the element's digit times the stride.
std::string KernelWriter::inputIndex(int64_t id, const rt::Shape &shape, const std::string &e) {
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

std::string KernelWriter::emitStep(const json &step, const std::vector<std::string> &a) {
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

} // namespace mlir::loom::kernelgen

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
          KernelWriter writer(rank, ins);
          if (ins.op.rfind("cross_entropy", 0) == 0)
            text += ins.attrs.contains("vocab_group") ? writer.writeVocabLoss() : writer.writeCrossEntropy();
          else if (ins.op == "layernorm_grad" || ins.op == "rmsnorm_grad")
            text += writer.writeNormGrad();
          else
            text += writer.writeRows();
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
