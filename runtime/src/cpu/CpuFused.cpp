//===- CpuFused.cpp - Fused elementwise kernels ---------------------------===//
//
// The evaluator of the elementwise chains that the compiler fuses into one
// instruction; it computes each step with Elementwise.h's functions, as the
// per-op kernels of CpuElementwise.cpp do.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuKernels.h"
#include "runtime/src/Elementwise.h"

#include <cmath>
#include <map>

namespace loom::rt::cpu {

namespace {

/// A chain of elementwise instructions fused by the compiler: attrs
/// "steps" (each {op, args, and the op's own attributes}; args index the
/// values: the inputs first, then each step's result) and "results" (the
/// values written to the outputs, in order). Inputs broadcast to the
/// output shape; every output has it.
Kernel buildFused(const Ctx &c) {
  if (c.ins.out.empty())
    c.bad("writes at least one output");
  const Shape &shape = c.out(0).shape;
  struct Input {
    float *data;
    std::vector<int64_t> strides; // over `shape`; empty when dense (same shape)
    int64_t count;
  };
  std::vector<Input> inputs;
  for (size_t i = 0; i < c.ins.in.size(); ++i) {
    c.needF32(c.in(i));
    Input in{c.f32(c.in(i)), {}, count(c.in(i).shape)};
    if (c.in(i).shape != shape) {
      auto st = broadcastStrides(c.in(i).shape, shape);
      if (!st)
        c.bad(cat("input ", shapeStr(c.in(i).shape), " does not broadcast to ", shapeStr(shape)));
      in.strides = *st;
    }
    inputs.push_back(std::move(in));
  }
  struct Step {
    int op; // 0 add 1 sub 2 mul 3 div 4 neg 5 scale 6 exp 7 tanh 8 rsqrt 9 relu 10 silu 11 gelu 12 gelu_tanh 13 unary_grad
    int a = 0, b = 0, d = 0;
    float factor = 1;
    ew::Fn fn = ew::Fn::Unknown;
  };
  static const std::map<std::string, int> codes = {
      {"add", 0}, {"sub", 1}, {"mul", 2}, {"div", 3}, {"neg", 4}, {"scale", 5}, {"exp", 6},
      {"tanh", 7}, {"rsqrt", 8}, {"relu", 9}, {"silu", 10}, {"gelu", 11}, {"unary_grad", 13}};
  auto stepsIt = c.ins.attrs.find("steps");
  auto resultsIt = c.ins.attrs.find("results");
  if (stepsIt == c.ins.attrs.end() || !stepsIt->is_array() || resultsIt == c.ins.attrs.end() ||
      !resultsIt->is_array() || resultsIt->size() != c.ins.out.size())
    c.bad("needs 'steps' and one 'results' entry per output");
  std::vector<Step> steps;
  int values = static_cast<int>(inputs.size());
  for (const auto &js : *stepsIt) {
    std::string op = js.value("op", std::string());
    auto code = codes.find(op);
    if (code == codes.end())
      c.bad("cannot fuse op '" + op + "'");
    Step st{code->second};
    if (op == "gelu" && js.value("approximate", false))
      st.op = 12;
    st.factor = static_cast<float>(js.value("factor", 1.0));
    std::vector<int> args;
    for (const auto &a : js.value("args", nlohmann::json::array())) {
      int v = a.get<int>();
      if (v < 0 || v >= values)
        c.bad(cat("step argument ", v, " is not a value defined before it"));
      args.push_back(v);
    }
    size_t want = st.op <= 3 ? 2 : st.op == 13 ? 3 : 1;
    if (args.size() != want)
      c.bad(cat("step '", op, "' takes ", want, " arguments"));
    st.a = args[0], st.b = args.size() > 1 ? args[1] : 0, st.d = args.size() > 2 ? args[2] : 0;
    if (st.op == 13 && (st.fn = ew::parseFn(js.value("fn", std::string()))) == ew::Fn::Unknown)
      c.bad("unary_grad step needs a known 'fn'");
    steps.push_back(st);
    ++values;
  }
  std::vector<int> results;
  std::vector<float *> outs;
  for (size_t k = 0; k < c.ins.out.size(); ++k) {
    int v = (*resultsIt)[k].get<int>();
    if (v < 0 || v >= values)
      c.bad(cat("result ", v, " is not a value"));
    c.needF32(c.out(k));
    if (c.out(k).shape != shape)
      c.bad("every output must have the first output's shape");
    results.push_back(v);
    outs.push_back(c.f32(c.out(k)));
  }
  int64_t n = count(shape);
  std::vector<int64_t> dims(shape.begin(), shape.end());
  ThreadPool *pool = &c.pool;
  return [=] {
    pool->parallelFor(n, 20.0 * double(values), [&](int64_t begin, int64_t end) {
      std::vector<float> v(static_cast<size_t>(values));
      for (int64_t i = begin; i < end; ++i) {
        for (size_t k = 0; k < inputs.size(); ++k) {
          const Input &in = inputs[k];
          int64_t at = i;
          if (!in.strides.empty()) { // broadcast: walk the output index's digits
            at = 0;
            int64_t rest = i;
            for (int d = static_cast<int>(dims.size()) - 1; d >= 0; --d) {
              at += (rest % dims[d]) * in.strides[d];
              rest /= dims[d];
            }
          }
          v[k] = in.data[at];
        }
        size_t at = inputs.size();
        for (const Step &s : steps) {
          float x = v[s.a], y = v[s.b], r = 0;
          switch (s.op) {
          case 0: r = x + y; break;
          case 1: r = x - y; break;
          case 2: r = x * y; break;
          case 3: r = x / y; break;
          case 4: r = -x; break;
          case 5: r = x * s.factor; break;
          case 6: r = std::exp(x); break;
          case 7: r = std::tanh(x); break;
          case 8: r = ew::rsqrt(x); break;
          case 9: r = ew::relu(x); break;
          case 10: r = ew::silu(x); break;
          case 11: r = ew::geluErf(x); break;
          case 12: r = ew::geluTanh(x); break;
          default: r = v[s.d] * ew::derivative(s.fn, x, y); break; // unary_grad(x, y, dy)
          }
          v[at++] = r;
        }
        for (size_t k = 0; k < results.size(); ++k)
          outs[k][i] = v[results[k]];
      }
    });
  };
}

} // namespace

void registerFusedBuilders(BuilderTable &table) {
  table.insert({
      {"fused", buildFused},
  });
}

} // namespace loom::rt::cpu
