//===- PlanMemory.cpp - One arena per rank, packed by lifetime ------------===//
//
// The loom-plan-memory pass. It rewrites the loomrt ops in place: it reads
// each rank's loomrt.buffer, loomrt.param and program ops and sets the
// buffers' `offset` and the rank's `arena_bytes` and `peak_bytes`, without
// going through the runtime's structures (StepState.h) as the other step
// passes still do.
//
//===----------------------------------------------------------------------===//

#include "passes/Passes.h"
#include "passes/StepState.h"
#include "dialects/loomrt/IR/LoomRtDialect.h"
#include "loom/rt/Checked.h"

#include <algorithm>
#include <climits>
#include <map>

namespace mlir::loom {
#define GEN_PASS_DEF_PLANMEMORY
#include "passes/Passes.h.inc"
} // namespace mlir::loom

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;

namespace {

constexpr int64_t kAlignment = 64;

/// A rank's buffer as the plan needs it.
struct PlanBuffer {
  loomrt::BufferOp op;
  int64_t bytes = 0;
  int64_t storage = -1; // the buffer whose memory it is (itself, or what its views lead to)
  int64_t into = 0;     // bytes into the storage where it starts (slice views)
  bool persistent = false;
};

/// The ODS getters of I64Attr return uint64_t: -1 ("none") comes back as
/// int64_t.
int64_t viewOf(loomrt::BufferOp b) { return int64_t(b.getViewOf()); }

/// The buffer ids an op of a program reads and writes.
FailureOr<std::pair<ArrayRef<int64_t>, ArrayRef<int64_t>>> operandsOf(Operation &op) {
  if (auto ins = dyn_cast<loomrt::InstrOp>(op))
    return std::make_pair(ins.getIns(), ins.getOuts());
  if (auto fused = dyn_cast<loomrt::FusedOp>(op))
    return std::make_pair(fused.getIns(), fused.getOuts());
  return failure();
}

LogicalResult planRank(loomrt::RankOp rank) {
  Block &body = rank.getBody().front();
  // Buffers, numbered densely from 0 in order (as the bundle writes them).
  std::vector<PlanBuffer> buffers;
  for (auto b : body.getOps<loomrt::BufferOp>()) {
    auto type = dyn_cast<RankedTensorType>(b.getType());
    std::optional<loom_dtype_t> dt = type ? dtypeOf(type.getElementType()) : std::nullopt;
    if (!dt || int64_t(b.getId()) != int64_t(buffers.size()) || !type.hasStaticShape())
      return b.emitError() << "malformed buffer (ids in order from 0, a static ranked tensor of "
                              "f32/f64/bf16/f16/i32/i64)";
    PlanBuffer pb;
    pb.op = b;
    pb.bytes = b.getBytes() ? int64_t(*b.getBytes()) : type.getNumElements() * int64_t(rt::dtypeSize(*dt));
    pb.persistent = b.getRole() != rt::roleName(rt::BufferRole::Activation);
    buffers.push_back(pb);
  }
  const int64_t n = int64_t(buffers.size());
  auto known = [&](int64_t id) { return id >= 0 && id < n; };
  // Each buffer's storage: views lead to a buffer with its own (no cycles).
  for (int64_t id = 0; id < n; ++id) {
    int64_t at = id;
    for (int64_t hops = 0; viewOf(buffers[at].op) >= 0; ++hops) {
      int64_t next = viewOf(buffers[at].op);
      buffers[id].into += int64_t(buffers[at].op.getViewOffset());
      if (!known(next) || hops >= n)
        return buffers[id].op.emitError() << "is a view of no buffer with storage of its own (view_of "
                                          << viewOf(buffers[id].op) << ")";
      at = next;
    }
    buffers[id].storage = at;
  }
  // A slice view lies inside the buffer it views; only views have one.
  for (int64_t id = 0; id < n; ++id) {
    loomrt::BufferOp b = buffers[id].op;
    int64_t into = int64_t(b.getViewOffset());
    if (into != 0 && viewOf(b) < 0)
      return b.emitError() << "has view_offset " << into << " but views no buffer (view_of)";
    if (viewOf(b) >= 0 && (into < 0 || into + buffers[id].bytes > buffers[viewOf(b)].bytes))
      return b.emitError() << "is a slice of " << buffers[id].bytes << " bytes at view_offset " << into
                           << ", outside the " << buffers[viewOf(b)].bytes << " bytes of buffer " << viewOf(b);
  }
  // The programs in execution order: the training step's, then any others
  // (a serving bundle's step programs, which run one at a time) by name.
  std::map<std::string, std::vector<loomrt::ProgramOp>> byName;
  for (auto prog : body.getOps<loomrt::ProgramOp>())
    byName[prog.getName().str()].push_back(prog);
  std::vector<std::string> order = {"forward", "step", "backward", "update"};
  for (const auto &[name, _] : byName)
    if (std::find(order.begin(), order.end(), name) == order.end())
      order.push_back(name);
  // Lifetimes over that order, by storage.
  std::vector<int64_t> first(size_t(n), INT64_MAX), last(size_t(n), -1);
  // An async collective reads its inputs on the communication stream until
  // its event is waited for: they live that long. The stream runs its work
  // in order, so a wait for one event is a wait for every collective issued
  // before it too. (event, the storages it reads), in issue order:
  std::vector<std::pair<int64_t, std::vector<int64_t>>> inFlight;
  int64_t index = 0;
  for (const std::string &name : order) {
    auto it = byName.find(name);
    if (it == byName.end())
      continue;
    for (loomrt::ProgramOp prog : it->second)
      for (Operation &op : prog.getBody().front()) {
        auto operands = operandsOf(op);
        if (failed(operands))
          return op.emitError() << "is not an instruction of a loomrt.program";
        for (ArrayRef<int64_t> ids : {operands->first, operands->second})
          for (int64_t id : ids) {
            if (!known(id))
              return op.emitError() << "names buffer " << id << "; the rank has " << n;
            int64_t s = buffers[size_t(id)].storage;
            first[size_t(s)] = std::min(first[size_t(s)], index);
            last[size_t(s)] = std::max(last[size_t(s)], index);
          }
        if (auto ins = dyn_cast<loomrt::InstrOp>(op)) {
          auto event = ins->getAttrOfType<IntegerAttr>("event");
          auto async = ins->getAttrOfType<BoolAttr>("async");
          if (event && ins.getOp() == "event_wait") {
            auto done = std::find_if(inFlight.rbegin(), inFlight.rend(),
                                     [&](const auto &e) { return e.first == event.getInt(); });
            auto end = done.base(); // one past the waited event's entry (begin() if not in flight)
            for (auto e = inFlight.begin(); e != end; ++e)
              for (int64_t s : e->second)
                last[size_t(s)] = std::max(last[size_t(s)], index);
            inFlight.erase(inFlight.begin(), end);
          } else if (event && async && async.getValue()) {
            std::vector<int64_t> reads;
            for (int64_t id : ins.getIns())
              reads.push_back(buffers[size_t(id)].storage);
            inFlight.push_back({event.getInt(), std::move(reads)});
          }
        }
        ++index;
      }
  }
  for (const auto &[event, storages] : inFlight) // never waited for: to the end
    for (int64_t s : storages)
      last[size_t(s)] = std::max(last[size_t(s)], index);
  // Parameter gradients stay readable after the step (the C API and the
  // optimizer read them), so they live to the end.
  for (auto p : body.getOps<loomrt::ParamOp>()) {
    int64_t grad = int64_t(p.getGrad());
    if (grad < 0)
      continue;
    if (!known(grad))
      return p.emitError() << "has gradient buffer " << grad << "; the rank has " << n;
    int64_t s = buffers[size_t(grad)].storage;
    last[size_t(s)] = index;
    first[size_t(s)] = std::min(first[size_t(s)], last[size_t(s)]);
  }
  // Persistent buffers first, in id order. Sizes are below 2^51 bytes each
  // (LowerToStep's limit), but thousands of them can still pass int64.
  auto tooLarge = [&] {
    return rank.emitError() << "rank " << int64_t(rank.getRank()) << " needs an arena of more than 2^63 bytes";
  };
  std::vector<int64_t> offsets(size_t(n), 0);
  std::optional<int64_t> offset = 0;
  std::vector<int64_t> activations;
  for (int64_t id = 0; id < n; ++id) {
    const PlanBuffer &b = buffers[size_t(id)];
    if (viewOf(b.op) >= 0)
      continue;
    if (!b.persistent) {
      activations.push_back(id);
      continue;
    }
    std::optional<int64_t> size = rt::checkedAlignUp(b.bytes, kAlignment);
    offset = size ? rt::checkedAdd(*offset, *size) : std::nullopt;
    if (!offset)
      return tooLarge();
    offsets[size_t(id)] = *offset - *size;
  }
  int64_t base = *offset;
  // Greedy by size: each activation takes the lowest offset that does not
  // overlap a placed activation whose lifetime intersects its own.
  std::stable_sort(activations.begin(), activations.end(),
                   [&](int64_t a, int64_t b) { return buffers[size_t(a)].bytes > buffers[size_t(b)].bytes; });
  struct Placed {
    int64_t begin, end, first, last;
  };
  std::vector<Placed> placed;
  int64_t peak = 0;
  for (int64_t id : activations) {
    std::optional<int64_t> aligned = rt::checkedAlignUp(buffers[size_t(id)].bytes, kAlignment);
    if (!aligned)
      return tooLarge();
    int64_t size = *aligned;
    std::vector<std::pair<int64_t, int64_t>> busy;
    for (const Placed &p : placed)
      if (!(p.last < first[size_t(id)] || last[size_t(id)] < p.first))
        busy.push_back({p.begin, p.end});
    std::sort(busy.begin(), busy.end());
    int64_t at = 0;
    for (auto [b, e] : busy) {
      if (std::optional<int64_t> end = rt::checkedAdd(at, size); end && *end <= b)
        break;
      at = std::max(at, e);
    }
    std::optional<int64_t> end = rt::checkedAdd(at, size);
    if (!end || !rt::checkedAdd(base, *end))
      return tooLarge();
    placed.push_back({at, *end, first[size_t(id)], last[size_t(id)]});
    offsets[size_t(id)] = base + at;
    peak = std::max(peak, *end);
  }
  // A view shares its storage's offset (a slice starts further in).
  for (PlanBuffer &b : buffers)
    b.op.setOffset(offsets[size_t(b.storage)] + b.into);
  rank.setPeakBytes(peak);
  rank.setArenaBytes(base + peak);
  return success();
}

struct PlanMemoryPass : mlir::loom::impl::PlanMemoryBase<PlanMemoryPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    bool found = false;
    for (auto bundle : module.getOps<loomrt::BundleOp>()) {
      found = true;
      for (auto rank : bundle.getBody().getOps<loomrt::RankOp>())
        if (failed(planRank(rank)))
          return signalPassFailure();
    }
    if (!found) {
      module.emitError() << getArgument() << " runs on the lowered step (a loomrt.bundle); run "
                                             "loom-lower-to-step first";
      signalPassFailure();
    }
  }
};

} // namespace
