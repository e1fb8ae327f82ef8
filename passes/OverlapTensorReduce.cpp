//===- OverlapTensorReduce.cpp - Tensor-parallel all-reduces beside compute ===//
//
// The loom-overlap-tensor-reduce pass. A Megatron-style layer's backward
// all-reduces the gradient of its column-parallel product's input over the
// tensor-parallel group, and only the layer norm's gradient after it reads
// the sum. The weight's own gradient, computed from the same output
// gradient, does not:
//
//   matmul(dy, w) -> dx                       the input's partial gradient
//   matmul(x, dy) -> dw, db                   the weight's gradient
//   all_reduce(dx) -> dx'   {group = "tp"}
//   layernorm_grad(..., dx', ...)
//
// so the all-reduce moves up to right after the instruction that writes its
// input, goes out on the communication stream, and the first instruction
// that reads its result (or writes its input) waits for it:
//
//   matmul(dy, w) -> dx
//   all_reduce(dx) -> dx'   {group = "tp", async, event = e}
//   matmul(x, dy) -> dw, db
//   event_wait {event = e}
//   layernorm_grad(..., dx', ...)
//
// The transfer then runs beside the weight gradient's GEMM instead of after
// it. An all-reduce is left alone where nothing would run beside it. The
// values are the same: only the order of independent instructions changes.
//
// With sequence parallelism the input's gradient is reduce-scattered
// instead (the gradient of the all-gather that entered the layer), and it
// moves the same way.
//
// Only where the rank has no data-parallel buckets: those go out on the
// same communication stream, in order, and a layer's all-reduce would wait
// behind them. (Sequence parallelism's own buckets, the norms' and biases'
// gradient sums over the tensor-parallel group, are small and may stay.)
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"

namespace mlir::loom {
#define GEN_PASS_DEF_OVERLAPTENSORREDUCE
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;
using json = nlohmann::json;

namespace {

bool asyncCollective(const rt::Instruction &ins) { return flagAttr(ins, "async"); }

/// Storages an instruction reads and writes (views resolved).
struct Uses {
  std::set<int64_t> reads, writes;
};

Uses usesOf(const rt::RankProgram &r, const rt::Instruction &ins) {
  Uses u;
  for (int64_t id : ins.in)
    u.reads.insert(rt::storageOf(r, id));
  for (int64_t id : ins.out)
    u.writes.insert(rt::storageOf(r, id));
  return u;
}

/// Moves the tensor-parallel all-reduces of one program; returns how many.
int64_t overlap(rt::RankProgram &r, std::vector<rt::Instruction> &list, int64_t &nextEvent) {
  int64_t moved = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    rt::Instruction &ins = list[i];
    bool scatter = ins.op == "reduce_scatter" && ins.attrs.is_object() && ins.attrs.contains("axis");
    if ((ins.op != "all_reduce" && !scatter) || asyncCollective(ins) || ins.in.size() != 1 ||
        ins.out.size() != 1 || !ins.attrs.is_object() || ins.attrs.value("group", std::string()) != "tp")
      continue;
    int64_t in = rt::storageOf(r, ins.in[0]), out = rt::storageOf(r, ins.out[0]);
    // Where it can go: after the last instruction before it that writes its
    // input or touches its output (in place: reads its input too).
    size_t from = 0;
    for (size_t j = i; j-- > 0;) {
      Uses u = usesOf(r, list[j]);
      bool pinned = u.writes.count(in) || u.writes.count(out) || u.reads.count(out);
      if (pinned) {
        from = j + 1;
        break;
      }
    }
    // Where its result is first needed: the first instruction after it that
    // reads or writes its output or writes its input, or a collective (one
    // stream's order must match the peers'); the program's end if none.
    size_t until = list.size();
    for (size_t j = i + 1; j < list.size(); ++j) {
      Uses u = usesOf(r, list[j]);
      if (u.reads.count(out) || u.writes.count(out) || u.writes.count(in) || ordersCollectives(list[j])) {
        until = j;
        break;
      }
    }
    // Nothing to run beside it: leave it as it is.
    if (until - from <= 1)
      continue;
    // No collective of this group may be passed over on its way up either.
    bool crosses = false;
    for (size_t j = from; j < i; ++j)
      crosses |= ordersCollectives(list[j]);
    if (crosses)
      continue;
    rt::Instruction reduce = std::move(ins);
    int64_t event = nextEvent++;
    reduce.attrs["async"] = true;
    reduce.attrs["event"] = event;
    rt::Instruction wait{"event_wait", {}, {}, json{{"event", event}}};
    list.erase(list.begin() + std::ptrdiff_t(i));
    // `until` shifts down by one with the erase; the wait goes first there.
    list.insert(list.begin() + std::ptrdiff_t(until - 1), std::move(wait));
    list.insert(list.begin() + std::ptrdiff_t(from), std::move(reduce));
    ++moved;
    // Continue after the wait: i now points at one of the passed-over instructions.
  }
  return moved;
}

struct OverlapTensorReducePass : mlir::loom::impl::OverlapTensorReduceBase<OverlapTensorReducePass> {
  void runOnOperation() override {
    auto rewrite = [&](rt::RankProgram &r, std::vector<rt::Instruction> &list, int64_t &event) {
      overlap(r, list, event);
    };
    if (failed(updateGroupPrograms(getOperation(), getArgument(), "tp", rewrite)))
      signalPassFailure();
  }
};

} // namespace
