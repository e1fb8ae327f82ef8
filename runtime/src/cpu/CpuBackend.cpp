//===- CpuBackend.cpp - Plain C++ execution of instruction streams --------===//
//
// CpuProgram checks every instruction once and turns it into a kernel through
// the one builder table, which the kernel files (CpuElementwise.cpp,
// CpuMatmul.cpp, ...; see CpuKernels.h) fill; bf16 operands are widened into
// f32 copies around each kernel. Also here: the communication stream
// (AsyncComm) and the backend that owns the arena.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/cpu/CpuBackend.h"
#include "runtime/src/Backend.h"
#include "loom/rt/Error.h"
#include "runtime/src/cpu/CpuKernels.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

namespace loom::rt {

namespace {

/// Names exactly the instructions of loom/instructions.def, the instruction
/// set the manifest reader validates against (InstructionTableTest checks
/// that the two lists agree): a new kernel needs its line there too.
const cpu::BuilderTable &builders() {
  static const cpu::BuilderTable table = [] {
    cpu::BuilderTable t;
    cpu::registerElementwiseBuilders(t);
    cpu::registerMatmulBuilders(t);
    cpu::registerNormBuilders(t);
    cpu::registerTransformerBuilders(t);
    cpu::registerServeBuilders(t);
    cpu::registerShapeBuilders(t);
    cpu::registerConvBuilders(t);
    cpu::registerGradientBuilders(t);
    cpu::registerOptimizerBuilders(t);
    cpu::registerCommunicationBuilders(t);
    cpu::registerFusedBuilders(t);
    return t;
  }();
  return table;
}

} // namespace

AsyncComm::AsyncComm() : worker([this] { loop(); }) {}

AsyncComm::~AsyncComm() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopping = true;
  }
  cv.notify_all();
  worker.join();
}

void AsyncComm::setTracer(std::function<void(const std::string &, double, double)> t) {
  std::lock_guard<std::mutex> lock(mutex);
  tracer = std::move(t);
}

void AsyncComm::submit(std::function<void()> task, int64_t event, std::string label) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    tasks.push_back({std::move(task), event, std::move(label)});
    ++submitted;
    if (event >= 0)
      eventAt[event] = submitted;
  }
  cv.notify_all();
}

void AsyncComm::wait(int64_t event) {
  std::unique_lock<std::mutex> lock(mutex);
  int64_t until = submitted;
  if (event >= 0) {
    auto it = eventAt.find(event);
    until = it == eventAt.end() ? 0 : it->second; // never recorded: nothing to wait for
  }
  cv.wait(lock, [&] { return completed >= until; });
  if (error) {
    std::exception_ptr e = error;
    error = nullptr;
    std::rethrow_exception(e);
  }
}

void AsyncComm::loop() {
  std::unique_lock<std::mutex> lock(mutex);
  for (;;) {
    cv.wait(lock, [&] { return stopping || !tasks.empty(); });
    if (tasks.empty())
      return; // stopping
    Task task = std::move(tasks.front());
    tasks.pop_front();
    ++running;
    bool failed = error != nullptr;
    auto trace = task.label.empty() ? nullptr : tracer;
    lock.unlock();
    try {
      if (!failed) {
        double t0 = Backend::traceClock();
        task.run();
        if (trace)
          trace(task.label, t0, Backend::traceClock());
      }
    } catch (...) {
      std::lock_guard<std::mutex> relock(mutex);
      if (!error)
        error = std::current_exception();
    }
    lock.lock();
    --running;
    ++completed;
    cv.notify_all();
  }
}

std::vector<std::string> cpuSupportedOps() {
  std::vector<std::string> ops;
  for (auto &[name, _] : builders())
    ops.push_back(name);
  return ops;
}

CpuProgram::CpuProgram(const RankProgram &rank, const std::vector<Instruction> &instrs,
                       char *arena, ThreadPool &pool, const std::string &programName,
                       bool allocate, Communicator *comm, AsyncComm *async) {
  static const std::set<std::string> bytewise = {"cast", "slice", "transpose", "concat",
                                                 "broadcast", "send", "recv", "kv_write"};
  // Operands a kernel reads, and results it writes, in their own dtype: the
  // key/value caches; the bf16 weight copies the optimizers write
  // (loom-update-copies), rounded in the kernel's own threads.
  static const std::map<std::string, std::set<size_t>> nativeIn = {{"paged_attention", {1, 2}}};
  static const std::map<std::string, std::set<size_t>> nativeOut = {{"adamw", {3}}, {"sgd", {2}}};
  auto native = [](const std::map<std::string, std::set<size_t>> &table, const std::string &op, size_t k) {
    auto it = table.find(op);
    return it != table.end() && it->second.count(k) > 0;
  };
  // Collectives may still read their operands after the next instructions
  // start (asynchronous ones): their f32 copies are their own. Every other
  // instruction's copies live only while it runs, so they share one buffer
  // sized for the largest (instructions run one after another).
  static const std::set<std::string> collectives = {"all_reduce", "reduce_scatter", "all_gather",
                                                    "broadcast_from", "shard_of"};
  auto widenedCount = [&](const Instruction &ins) {
    std::set<int64_t> ids;
    for (size_t k = 0; k < ins.in.size(); ++k)
      if (!native(nativeIn, ins.op, k))
        ids.insert(ins.in[k]);
    for (size_t k = 0; k < ins.out.size(); ++k)
      if (!native(nativeOut, ins.op, k))
        ids.insert(ins.out[k]);
    int64_t n = 0;
    for (int64_t id : ids)
      if (rank.buffers[id].dtype == LOOM_BF16)
        n += std::max<int64_t>(numElements(rank.buffers[id].shape).value_or(0), 1);
    return n;
  };
  int64_t sharedCount = 0;
  if (allocate)
    for (const Instruction &ins : instrs)
      if (!bytewise.count(ins.op) && !collectives.count(ins.op))
        sharedCount = std::max(sharedCount, widenedCount(ins));
  if (sharedCount > 0)
    scratch.emplace_back(static_cast<size_t>(sharedCount));
  float *shared = sharedCount > 0 ? scratch.back().data() : nullptr;
  for (size_t i = 0; i < instrs.size(); ++i) {
    const Instruction &ins = instrs[i];
    std::string where = cat("instruction ", programName, "[", i, "] '", ins.op, "'");
    auto it = builders().find(ins.op);
    if (it == builders().end())
      fail(LOOM_UNSUPPORTED, where, ": the CPU backend has no kernel for this op");
    // bf16 storage, f32 compute: each bf16 operand is widened into an f32
    // copy before the kernel and each bf16 result narrowed after it. Casts
    // convert themselves and data movement (slice, transpose, concat,
    // broadcast) copies bytes of any dtype, so those run on bf16 directly.
    std::map<int64_t, float *> widened;
    struct Copy {
      char *bf16;
      float *f32;
      int64_t count;
    };
    std::vector<Copy> widen, narrow; // operands in, results out
    if (!bytewise.count(ins.op)) {
      bool own = collectives.count(ins.op) > 0;
      int64_t next = 0; // in the shared buffer
      auto add = [&](int64_t id, std::vector<Copy> &list) {
        const Buffer &b = rank.buffers[id];
        if (b.dtype != LOOM_BF16)
          return;
        if (auto w = widened.find(id); w != widened.end()) {
          // A result written over an operand (the loss's gradient over the
          // logits) is narrowed back from the operand's copy.
          if (&list == &narrow && !own)
            narrow.push_back({arena + b.offset, w->second, numElements(b.shape).value_or(0)});
          return;
        }
        int64_t n = numElements(b.shape).value_or(0);
        float *copy = reinterpret_cast<float *>(arena); // validation only: never run
        if (allocate && own) {
          scratch.emplace_back(static_cast<size_t>(std::max<int64_t>(n, 1)));
          copy = scratch.back().data();
        } else if (allocate) {
          copy = shared + next;
          next += std::max<int64_t>(n, 1);
        }
        widened[id] = copy;
        list.push_back({arena + b.offset, copy, n});
      };
      for (size_t k = 0; k < ins.in.size(); ++k)
        if (!native(nativeIn, ins.op, k))
          add(ins.in[k], widen);
      for (size_t k = 0; k < ins.out.size(); ++k)
        if (!native(nativeOut, ins.op, k))
          add(ins.out[k], narrow);
    }
    cpu::Ctx ctx{ins, rank, arena, pool, where, widened, comm, async};
    std::function<void()> kernel = it->second(ctx);
    // An "async" collective only hands its work to the communication thread.
    bool queues = async && ins.attrs.is_object() && ins.attrs.value("async", false);
    // An async all-reduce's results are not there yet when it returns: it
    // writes its bf16 ones (means reduced in place) to their storage
    // itself, when it has them.
    if (queues && ins.op == "all_reduce")
      narrow.clear();
    if (!widened.empty())
      kernel = [kernel, widen, narrow] {
        for (const Copy &c : widen)
          for (int64_t e = 0; e < c.count; ++e)
            c.f32[e] = bf16ToFloat(reinterpret_cast<const uint16_t *>(c.bf16)[e]);
        kernel();
        for (const Copy &c : narrow)
          for (int64_t e = 0; e < c.count; ++e)
            reinterpret_cast<uint16_t *>(c.bf16)[e] = floatToBf16(c.f32[e]);
      };
    // An async all-gather's builder does its work in place: all of it, the
    // bf16 copies' narrowing too, goes to the communication thread, in
    // order with the buckets there (ZeRO-3 gathers beside the backward's
    // reduce-scatters).
    if (queues && ins.op == "all_gather") {
      int64_t event = ins.attrs.value("event", int64_t(-1));
      kernel = [async, kernel, event, where] { async->submit(kernel, event, where); };
    }
    steps.push_back(Step{where, ins.op, std::move(kernel), queues});
  }
}

/// Runs one step; an error that does not yet say where it happened (a
/// collective that timed out, a peer that failed) gets the instruction.
static void runStep(CpuProgram::Step &step) {
  try {
    step.kernel();
  } catch (const Error &e) {
    if (std::string(e.what()).find(step.what) != std::string::npos)
      throw;
    throw Error(e.code, cat(step.what, ": ", e.what()));
  }
}

void CpuProgram::run() {
  for (Step &step : steps)
    runStep(step);
}

void CpuProgram::runTimed(const std::function<void(const CpuProgramStep &, double, double)> &timed) {
  for (Step &step : steps) {
    double t0 = Backend::traceClock();
    runStep(step);
    timed(step, t0, Backend::traceClock());
  }
}

} // namespace loom::rt

namespace loom::rt {

void Backend::uploadFromDevice(const Buffer &b, const void *, int device) {
  fail(LOOM_INVALID_ARGUMENT, "input '", b.name, "' comes from the memory of CUDA device ", device,
       " but this session runs on the ", name(), " backend; bind host memory (copy it to the CPU) "
       "or open the session with the cuda backend");
}

void Backend::argmaxRows(const Buffer &b, int64_t rows, int64_t cols, int32_t *out) {
  int64_t size = b.dtype == LOOM_BF16 ? 2 : 4;
  if ((b.dtype != LOOM_BF16 && b.dtype != LOOM_F32) || cols < 1 || rows < 0 || rows * cols * size > b.bytes)
    fail(LOOM_INVALID_ARGUMENT, "argmax of ", rows, " rows of ", cols, " over '", b.name, "' (", dtypeName(b.dtype),
         shapeStr(b.shape), ")");
  std::vector<char> copy;
  const char *all = hostData(b); // read in place where the arena is host memory
  if (!all) {
    copy.resize(size_t(b.bytes));
    download(b, copy.data());
    all = copy.data();
  }
  for (int64_t r = 0; r < rows; ++r) {
    int32_t best = 0;
    float top = -INFINITY;
    bool any = false;
    for (int64_t c = 0; c < cols; ++c) {
      float v = float(loadAsDouble(b.dtype, all, r * cols + c));
      if (v == v && (!any || v > top))
        top = v, best = int32_t(c), any = true;
    }
    out[r] = best;
  }
}

double denseInstructionFlops(const RankProgram &rank, const Instruction &ins) {
  auto count = [](const Shape &s) { return double(numElements(s).value_or(0)); };
  if (ins.op == "matmul" && ins.in.size() >= 2 && ins.in.size() <= 4 && !ins.out.empty()) { // 3, 4: epilogue inputs
    const Buffer &a = rank.buffers[ins.in[0]], &o = rank.buffers[ins.out[0]];
    if (a.shape.size() < 2)
      return 0;
    auto it = ins.attrs.find("transpose_a");
    bool ta = it != ins.attrs.end() && it->is_boolean() && it->get<bool>();
    return 2.0 * count(o.shape) * double(ta ? a.shape[a.shape.size() - 2] : a.shape.back());
  }
  if ((ins.op == "attention" || ins.op == "attention_grad") && ins.attrs.contains("packed") && !ins.out.empty()) {
    // Self-attention over q|k|v columns: q's shape is O's (dO's for the gradient).
    const Buffer &q = rank.buffers[ins.op == "attention" ? ins.out[0] : ins.in.back()];
    if (q.shape.size() != 3)
      return 0;
    double fwd = 4.0 * count(q.shape) * double(q.shape[1]);
    return ins.op == "attention" ? fwd : 3 * fwd;
  }
  if ((ins.op == "attention" || ins.op == "attention_grad") && ins.in.size() >= 2) {
    const Buffer &q = rank.buffers[ins.in[0]], &k = rank.buffers[ins.in[1]];
    if (k.shape.size() != 3)
      return 0;
    double fwd = 4.0 * count(q.shape) * double(k.shape[1]);
    return ins.op == "attention" ? fwd : 3 * fwd; // recompute + three products
  }
  return 0;
}

namespace {
class CpuBackendImpl : public Backend {
public:
  CpuBackendImpl(const RankProgram &rank, int threads, Communicator *comm)
      : rank(rank), pool(threads), comm(comm) {
    size_t bytes = (static_cast<size_t>(rank.arenaBytes) + 63) / 64 * 64;
    arena.reset(static_cast<char *>(std::aligned_alloc(64, std::max<size_t>(bytes, 64))));
    if (!arena)
      fail(LOOM_INVALID_ARGUMENT, "cannot allocate rank ", rank.rank, "'s arena of ", rank.arenaBytes,
           " bytes (manifest field 'arena_bytes'): out of host memory");
    std::memset(arena.get(), 0, bytes);
  }
  std::string name() const override { return "cpu"; }
  void upload(const Buffer &b, const void *src) override {
    std::memcpy(arena.get() + b.offset, src, b.bytes);
  }
  void download(const Buffer &b, void *dst) const override {
    std::memcpy(dst, arena.get() + b.offset, b.bytes);
  }
  void prepare(const std::string &program, const std::vector<Instruction> &instrs) override {
    programs[program] =
        std::make_unique<CpuProgram>(rank, instrs, arena.get(), pool, program, true, comm, &async);
    programFlops[program].clear();
    for (const Instruction &ins : instrs)
      programFlops[program][ins.op] += denseInstructionFlops(rank, ins);
  }
  bool has(const std::string &program) const override { return programs.count(program) > 0; }
  void run(const std::string &program) override {
    if (!profiling && !tracing)
      return programs.at(program)->run();
    // The communication thread's collectives get their own track.
    // (Its labels are the instructions' "instruction backward[12] 'all_reduce'".)
    async.setTracer(tracing ? [this](const std::string &what, double t0, double t1) {
      addTrace({opOfLabel(what), "communication", what, t0, t1 - t0});
    } : std::function<void(const std::string &, double, double)>());
    std::map<std::string, int64_t> counted;
    programs.at(program)->runTimed([&](const CpuProgram::Step &step, double t0, double t1) {
      if (profiling) {
        OpTime &t = times[step.op];
        t.seconds += t1 - t0;
        t.count += 1;
        if (!counted[step.op]++)
          t.flops += programFlops[program][step.op];
      }
      if (tracing && !step.queues) // its interval is on the communication track
        addTrace({step.op, "compute", step.what, t0, t1 - t0});
    });
  }
  char *hostData(const Buffer &b) override { return arena.get() + b.offset; }

private:
  const RankProgram &rank;
  ThreadPool pool;
  Communicator *comm;
  AsyncComm async;
  std::unique_ptr<char, decltype(&std::free)> arena{nullptr, &std::free};
  std::map<std::string, std::unique_ptr<CpuProgram>> programs;
  std::map<std::string, std::map<std::string, double>> programFlops; // program -> op -> FLOPs
};
} // namespace

std::unique_ptr<Backend> makeCpuBackend(const RankProgram &rank, int threads,
                                        Communicator *comm) {
  return std::make_unique<CpuBackendImpl>(rank, threads, comm);
}

} // namespace loom::rt
