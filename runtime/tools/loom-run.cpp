//===- loom-run.cpp - Run a bundle ----------------------------------------===//
//
// loom-run OUT.loom [--input F.safetensors] [--output F.safetensors]
//                   [--steps N] [--threads T] [--seed S] [--timeout SECONDS]
// loom-run TRAIN.loom --steps N [--data F.bin] [--save-every K --checkpoint DIR]
//                     [--resume DIR]
//
// Inference bundles: binds inputs from a safetensors file (or synthetic ones:
// token ids drawn below each input's limit, floats from N(0, 1)), runs the
// forward pass --steps times after one warm-up, and prints each output's
// summary and the time per step.
//
// Training bundles: trains until step N on a token file (a flat array of
// uint16 or uint32 ids, as nanoGPT's data scripts write) or on synthetic
// tokens, printing step, loss, tokens/s and elapsed time; checkpoints every
// K steps (temporary file, then rename) and resumes from one exactly.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"
#include "runtime/src/Session.h"
#include "runtime/src/Communicator.h"
#include "runtime/src/MpiCommunicator.h"
#include "runtime/src/ProcessJob.h"
#include "runtime/src/StartLine.h"
#include "runtime/src/ThreadPool.h"
#include "runtime/src/Trace.h"
#include "runtime/src/TokenData.h"
#include "runtime/tools/Generate.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <nlohmann/json.hpp>
#include <fstream>
#include <optional>
#include <sys/stat.h>
#include <mutex>
#include <thread>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <limits>
#include <csignal>
#include <cstring>
#include <pthread.h>
#include <random>
#include <string>

using namespace loom::rt;

namespace {

/// Set when a launcher (mpirun, Slurm) started this process as one rank:
/// errors end the whole job.
Communicator *processComm = nullptr;
std::atomic<int> rankOfProcess{0}; // read by the SIGTERM thread
/// Set when the ranks are GPUs of this process: a failure aborts NCCL.
NcclWorld *ncclWorld = nullptr;
/// Set once a rank's error has been printed (main does not print it again).
std::atomic<bool> errorReported{false};
/// How long the ranks have to stop after an error before the process exits
/// without them.
constexpr int kStopSeconds = 15;

/// Prints a rank's error at once, and makes sure the process ends: stopping
/// after a failure joins the other ranks' threads and frees their GPU
/// memory, and a GPU kernel that still waits on a peer (NCCL) would block
/// that forever. After kStopSeconds the process exits with the error.
void reportFailure(const std::string &message) {
  if (errorReported.exchange(true))
    return;
  std::fprintf(stderr, "loom-run: error: %s\n", message.c_str());
  std::fflush(stderr);
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(kStopSeconds));
    std::fprintf(stderr, "loom-run: the ranks did not stop within %d s of the error above (a GPU kernel "
                 "or a peer still holds them); exiting\n", kStopSeconds);
    std::fflush(stderr);
    std::_Exit(1);
  }).detach();
}
void usage(FILE *to) {
  std::fprintf(to,
               "usage: loom-run BUNDLE [options]\n\n"
               "Runs the forward pass of a bundle written by `loomc compile` and prints its\n"
               "outputs and timing.\n\n"
               "  --input F.safetensors   inputs by name (default: synthetic inputs)\n"
               "  --output F.safetensors  write the outputs there\n"
               "  --steps N               timed runs after one warm-up (default 1)\n"
               "  --backend B             cpu (default) or cuda\n"
               "  --threads T             CPU threads (default: all)\n"
               "  --seed S                seed for synthetic inputs (default 0)\n"
               "  --timeout SECONDS       how long a rank of a multi-rank bundle waits for the\n"
               "                          others in one collective or transfer before every\n"
               "                          rank stops with an error (default 300, at most 86400;\n"
               "                          threads, processes of mpirun or Slurm, NCCL on GPUs)\n"
               "  --deterministic         the same results bit for bit in every run on the same\n"
               "                          GPU (ordered sums instead of atomics, cuDNN's\n"
               "                          deterministic attention backward, cuBLASLt's first\n"
               "                          heuristic choice instead of the fastest; sets\n"
               "                          LOOM_DETERMINISTIC=1)\n"
               "  --profile F.json        time every instruction by op, print the table and\n"
               "                          write the calibration profile for loomc plan --profile\n"
               "  --trace F.json          write every rank's instructions as a timeline (Chrome\n"
               "                          trace events: open in ui.perfetto.dev); under mpirun\n"
               "                          each process writes F.rankN.json\n\n"
               "Training bundles (loomc compile --train):\n"
               "  --steps N               train until step N (default 10)\n"
               "  --data F                token file: flat uint16 ids (uint32 with --data-dtype)\n"
               "  --data-dtype T          uint16 (default) or uint32\n"
               "  --save-every K          write a checkpoint every K steps (needs --checkpoint)\n"
               "  --checkpoint DIR        where checkpoints go (DIR/checkpoint.safetensors; one\n"
               "                          file per rank, checkpoint.rank-K.safetensors, for\n"
               "                          multi-rank bundles)\n"
               "  --resume DIR            continue from the checkpoint(s) in DIR\n\n");
  std::fputs(generateUsage(), to);
}

double valueAt(const Buffer &b, const char *p, int64_t i) { return loadAsDouble(b.dtype, p, i); }

void fillSynthetic(Session &s, const NamedBuffer &nb, std::mt19937_64 &rng) {
  const Buffer &b = s.rank().buffers[nb.buffer];
  int64_t n = numElements(b.shape).value_or(0);
  std::vector<char> data(b.bytes);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < n; ++i) {
    switch (b.dtype) {
    case LOOM_F32: reinterpret_cast<float *>(data.data())[i] = normal(rng); break;
    case LOOM_I32: reinterpret_cast<int32_t *>(data.data())[i] = int32_t(rng() % uint64_t(nb.limit > 0 ? nb.limit : 2)); break;
    case LOOM_I64: reinterpret_cast<int64_t *>(data.data())[i] = int64_t(rng() % uint64_t(nb.limit > 0 ? nb.limit : 2)); break;
    default: fail(LOOM_UNSUPPORTED, "no synthetic data for ", dtypeName(b.dtype), " input '", nb.name, "'");
    }
  }
  s.bindInput(nb.name, data.data(), data.size());
}

/// Prints where the time went by op and writes the calibration profile the
/// planner reads (loomc plan --profile): achieved matrix FLOP/s.
/// Wall time and steps of the last training run, for the profile's launch cost.
double runSeconds = 0;
int64_t runSteps = 0;
/// Mean time of the last training run's timed steps (after its warm-up).
double trainedStepSeconds = 0;

/// `stepSeconds`: a training step timed without per-instruction events (0
/// if not measured): what the planner calibrates its whole-step prediction
/// against for this model and batch.
void reportProfile(const Session &s, const std::string &path, double stepSeconds = 0) {
  double total = 0, mmSeconds = 0, mmFlops = 0;
  std::vector<std::pair<std::string, Backend::OpTime>> ops(s.profile().begin(), s.profile().end());
  for (auto &[op, t] : ops) {
    total += t.seconds;
    if (t.flops > 0)
      mmSeconds += t.seconds, mmFlops += t.flops;
  }
  std::sort(ops.begin(), ops.end(), [](auto &a, auto &b) { return a.second.seconds > b.second.seconds; });
  std::printf("profile (%s backend): %.1f ms in instructions\n", s.backendName().c_str(), total * 1e3);
  std::printf("  %-20s %8s %10s %7s %12s\n", "op", "count", "ms", "share", "TFLOP/s");
  for (auto &[op, t] : ops) {
    std::printf("  %-20s %8lld %10.2f %6.1f%%", op.c_str(), (long long)t.count, t.seconds * 1e3,
                total > 0 ? 100 * t.seconds / total : 0.0);
    if (t.flops > 0)
      std::printf(" %12.1f", t.flops / t.seconds / 1e12);
    std::printf("\n");
  }
  // The dtype the products ran in: bf16 operands on bf16 tensor cores, f32
  // ones on TF32 (CUDA) or f32 (CPU).
  std::string mmDtype = s.backendName() == "cuda" ? "tf32" : "f32";
  for (auto &[name, list] : s.rank().programs)
    for (const Instruction &ins : list)
      if (ins.op == "matmul" && !ins.in.empty() && s.rank().buffers[ins.in[0]].dtype == LOOM_BF16)
        mmDtype = "bf16";
  nlohmann::json doc = {{"backend", s.backendName()},
                        {"matmul_flops_per_s", mmSeconds > 0 ? mmFlops / mmSeconds : 0.0},
                        {"matmul_dtype", mmDtype},
                        {"matmul_share", total > 0 ? mmSeconds / total : 0.0},
                        // Both backends run async collectives (gradient buckets) beside compute.
                        {"overlaps_collectives", true},
                        {"ops", nlohmann::json::object()}};
  for (auto &[op, t] : ops)
    doc["ops"][op] = {{"count", t.count}, {"seconds", t.seconds}, {"flops", t.flops}};
  // Wall time the instructions' own times do not account for, per launch:
  // what the planner charges every instruction of every microbatch pass.
  int64_t instructions = 0;
  for (auto &[name, list] : s.rank().programs)
    instructions += static_cast<int64_t>(list.size());
  if (runSteps > 0 && instructions > 0) {
    double launch = std::max(0.0, (runSeconds - total) / double(runSteps * instructions));
    doc["launch_seconds"] = launch;
    doc["instructions_per_step"] = instructions;
    std::printf("  %.2f us per instruction outside the kernels (%lld instructions per step)\n",
                launch * 1e6, (long long)instructions);
  }
  if (stepSeconds > 0) {
    doc["step_seconds"] = stepSeconds;
    doc["model"] = s.manifest().model;
    doc["batch"] = s.manifest().batch;
    doc["ranks"] = s.manifest().ranks.size();
    doc["cuda_graphs"] = s.replaysGraphs();
    std::printf("  %.1f ms per step without the profile's events%s\n", stepSeconds * 1e3,
                s.replaysGraphs() ? " (CUDA graphs)" : "");
  }
  std::string text = doc.dump(1);
  writeFileAtomically(path, text.data(), text.size());
  std::printf("wrote %s\n", path.c_str());
}

/// Under a launcher, SIGTERM is how mpirun (or Slurm) ends the other ranks
/// when one dies: say which rank is gone, as Loom's own error, before going.
/// Called before MPI starts its threads, so that every thread blocks SIGTERM
/// and this one takes it.
void reportLauncherSignals() {
  static sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([] {
    int signal = 0;
    while (sigwait(&set, &signal) != 0) {
    }
    std::string lost = describeLostMpiRanks();
    std::fprintf(stderr, "loom-run: error: rank %d stopped by SIGTERM from the launcher: %s\n",
                 rankOfProcess.load(),
                 lost.empty() ? "another rank failed or the job was cancelled" : lost.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }).detach();
}

/// Runs `work`, turning any other exception into an Error: one escaping a
/// rank's thread would end the process.
template <typename Work> void asError(Work work) {
  try {
    work();
  } catch (const Error &) {
    throw;
  } catch (const std::bad_alloc &) {
    fail(LOOM_INVALID_ARGUMENT, "out of host memory");
  } catch (const std::exception &e) {
    fail(LOOM_INTERNAL, "internal error: ", e.what());
  }
}

/// The threads that run the ranks of this process, kept from one step to the
/// next: threads started and joined each step cost a dp2 step on two H200s
/// 0.2-0.3 ms (eleventh session, docs/benchmarks.md).
ThreadPool &rankThreads(size_t ranks) {
  static std::unique_ptr<ThreadPool> pool;
  if (!pool || pool->size() < int(ranks))
    pool = std::make_unique<ThreadPool>(int(ranks));
  return *pool;
}

/// Runs `work` on every rank of this process, each on its own thread; the
/// first rank to fail stops the others (through the communicator, and NCCL
/// aborts), and its error, naming the rank, is the one thrown.
template <typename Work>
void onEveryRank(std::vector<std::unique_ptr<Session>> &ranks, const std::shared_ptr<Communicator> &comm,
                 Work work) {
  std::mutex mutex;
  std::optional<Error> first;
  auto guarded = [&](size_t r) {
    try {
      asError([&] { work(*ranks[r]); });
    } catch (const Error &e) {
      std::lock_guard<std::mutex> lock(mutex);
      int64_t rank = ranks[r]->rank().rank;
      bool several = ranks[r]->manifest().ranks.size() > 1; // here, or in other processes
      if (!first) {
        first = several ? Error(e.code, cat("rank ", rank, ": ", e.what())) : e;
        if (several || ncclWorld)
          reportFailure(first->what());
      }
      if (comm) // the other ranks (threads or processes) stop too
        comm->abort(static_cast<int>(rank), e.what());
      if (ncclWorld) // ranks blocked in NCCL return once their communicators abort
        abortNcclWorld(*ncclWorld, cat("rank ", rank, ": ", e.what()));
    }
  };
  if (ranks.size() == 1) {
    guarded(0);
  } else { // this thread runs the first rank, the pool's workers the others
    rankThreads(ranks.size()).parallelFor(
        int64_t(ranks.size()), 1e18,
        [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r)
            guarded(size_t(r));
        },
        /*chunksPerThread=*/1);
  }
  if (first)
    throw *first;
}

/// Training steps before the timed ones (the trained: line and the step times).
constexpr int64_t kWarmupSteps = 3;

/// LOOM_RUN_STEP_TIMES=1: where a step's time goes on the host, per rank:
/// from the step's start to the rank's, the rank's own step, and from its
/// end to the step's (the other ranks, the threads' join, reading the loss).
struct StepTimes {
  bool on = [] {
    const char *e = std::getenv("LOOM_RUN_STEP_TIMES");
    return e && std::string(e) == "1";
  }();
  int64_t seen = 0, timed = 0;
  std::vector<double> startMs, ownMs, afterMs;
  template <typename Time>
  void add(Time t0, const std::vector<Time> &began, const std::vector<Time> &ended, Time t1) {
    if (++seen <= kWarmupSteps) // as the trained: line
      return;
    auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    startMs.resize(began.size()), ownMs.resize(began.size()), afterMs.resize(began.size());
    for (size_t k = 0; k < began.size(); ++k)
      startMs[k] += ms(t0, began[k]), ownMs[k] += ms(began[k], ended[k]), afterMs[k] += ms(ended[k], t1);
    ++timed;
  }
  void report() const {
    for (size_t k = 0; k < startMs.size(); ++k)
      std::printf("step times, rank %zu of this process: starts %.3f ms into the step, runs %.3f ms, ends "
                  "%.3f ms before the step's end (mean of %lld steps)\n",
                  k, startMs[k] / timed, ownMs[k] / timed, afterMs[k] / timed, (long long)timed);
  }
} stepTimes;

/// One training step on every rank: each rank's thread binds its inputs
/// (bind(k) for the k-th rank of this process, in parallel, as a process per
/// GPU would), waits for the others, and steps. The loss (the same on every
/// rank) and the step's time, from the ranks' common start to the last one's
/// end.
template <typename Bind>
std::pair<float, double> stepAllRanks(std::vector<std::unique_ptr<Session>> &ranks,
                                      const std::shared_ptr<Communicator> &comm, Bind bind) {
  using Clock = std::chrono::steady_clock;
  StartLine line(ranks.size());
  std::vector<Clock::time_point> began(ranks.size()), ended(ranks.size());
  onEveryRank(ranks, comm, [&](Session &s) {
    size_t k = 0;
    while (ranks[k].get() != &s)
      ++k;
    try {
      bind(k);
    } catch (...) {
      line.fail();
      throw;
    }
    if (!line.arriveAndWait())
      return; // another rank failed; its error is the one reported
    began[k] = Clock::now();
    s.trainStep(); // a failure here stops the others through the communicators
    ended[k] = Clock::now();
  });
  float loss = ranks[0]->loss();
  auto t1 = Clock::now();
  if (stepTimes.on)
    stepTimes.add(line.released, began, ended, t1);
  return {loss, std::chrono::duration<double>(t1 - line.released).count()};
}

int train(std::vector<std::unique_ptr<Session>> &ranks,
          const std::shared_ptr<Communicator> &comm, int steps, const std::string &data,
          const std::string &dataDtype, int saveEvery, const std::string &checkpointDir,
          const std::string &resume, uint64_t seed) {
  Session &s = *ranks[0];
  const RankProgram &r = s.rank();
  // Ranks of one data-parallel replica (tensor and pipeline parallel
  // partners) read the same examples; replica i reads the i-th slice of the
  // global batch.
  auto replica = [](const RankProgram &rank) {
    auto it = rank.coords.find("dp");
    return it == rank.coords.end() ? rank.rank : it->second;
  };
  std::vector<int64_t> replicaOf;
  for (size_t k = 0; k < ranks.size(); ++k)
    replicaOf.push_back(replica(ranks[k]->rank()));
  int64_t numRanks = 0; // replicas, over every rank of the bundle
  for (const RankProgram &rank : s.manifest().ranks)
    numRanks = std::max(numRanks, replica(rank) + 1);
  size_t bundleRanks = s.manifest().ranks.size();
  // Measuring one rank alone, a ZeRO gather fills only the rank's own slice
  // of each weight, so the losses may well be nan: keep timing.
  bool measuringAlone = std::getenv("LOOM_MEASURE_ONE_RANK") != nullptr && bundleRanks > ranks.size();
  auto checkpointFile = [&](const std::string &dir, size_t k) {
    return bundleRanks == 1 ? dir + "/checkpoint.safetensors"
                            : dir + "/checkpoint.rank-" + std::to_string(ranks[k]->rank().rank) +
                                  ".safetensors";
  };
  // Language models ([batch, seq] tokens and targets) read token files; any
  // other model trains on synthetic inputs drawn afresh each step.
  bool languageModel = r.inputs.size() == 2 &&
                       r.buffers[r.inputs[0].buffer].shape.size() == 2 &&
                       r.buffers[r.inputs[0].buffer].shape == r.buffers[r.inputs[1].buffer].shape &&
                       r.buffers[r.inputs[0].buffer].dtype == LOOM_I32 &&
                       r.buffers[r.inputs[1].buffer].dtype == LOOM_I32;
  if (!languageModel && !data.empty())
    fail(LOOM_UNSUPPORTED, "--data feeds [batch, seq] tokens and targets; this model's inputs "
         "are different (train it on synthetic inputs, or drive it through the C API)");
  int64_t batch = 1, seq = 1, vocab = 0;
  if (languageModel) {
    batch = r.buffers[r.inputs[0].buffer].shape[0];
    seq = r.buffers[r.inputs[0].buffer].shape[1];
    vocab = r.inputs[0].limit;
  } else if (!r.inputs.empty() && !r.buffers[r.inputs[0].buffer].shape.empty()) {
    batch = r.buffers[r.inputs[0].buffer].shape[0];
  }
  if (saveEvery > 0 && checkpointDir.empty())
    fail(LOOM_INVALID_ARGUMENT, "--save-every needs --checkpoint DIR");
  std::optional<TokenData> tokens;
  if (!data.empty())
    tokens.emplace(data, dataDtype, batch * numRanks, seq, vocab);
  if (!resume.empty()) {
    for (size_t k = 0; k < ranks.size(); ++k) {
      ranks[k]->loadCheckpoint(checkpointFile(resume, k));
      if (ranks[k]->step() != s.step())
        fail(LOOM_INVALID_ARGUMENT, checkpointFile(resume, k), " is at step ", ranks[k]->step(),
             " but ", checkpointFile(resume, 0), " at step ", s.step(),
             " (a save was cut off part-way); resume from an older checkpoint");
    }
    std::printf("resumed from %s at step %lld\n", checkpointFile(resume, 0).c_str(),
                (long long)s.step());
  }
  std::vector<int32_t> in(languageModel ? numRanks * batch * seq : 0),
      target(languageModel ? numRanks * batch * seq : 0);
  auto start = std::chrono::steady_clock::now();
  double timedSeconds = 0;
  int64_t timedSteps = 0;
  int64_t first = s.step() + 1;
  for (int64_t t = first; t <= steps; ++t) {
    if (languageModel && tokens) {
      tokens->fill(t, in, target);
    } else if (languageModel) { // synthetic: a fixed stream per step, reproducible on resume
      std::mt19937_64 rng(seed * 1000003 + t);
      for (size_t i = 0; i < in.size(); ++i)
        in[i] = static_cast<int32_t>(rng() % uint64_t(vocab > 0 ? vocab : 2));
      for (size_t i = 0; i < in.size(); ++i)
        target[i] = in[(i + 1) % in.size()];
    }
    auto bind = [&](size_t k) {
      if (!languageModel) { // synthetic inputs, seeded by the step: reproducible on resume
        std::mt19937_64 rng(seed * 1000003 + t + 7919 * replicaOf[k]); // the same examples within a replica
        for (const NamedBuffer &nb : r.inputs)
          fillSynthetic(*ranks[k], nb, rng);
        return;
      }
      // rank k takes examples [k b, (k + 1) b) of the global batch
      size_t slice = static_cast<size_t>(batch * seq), at = replicaOf[k] * slice;
      ranks[k]->bindInput(r.inputs[0].name, in.data() + at, slice * 4);
      ranks[k]->bindInput(r.inputs[1].name, target.data() + at, slice * 4);
    };
    auto [loss, stepSeconds] = stepAllRanks(ranks, comm, bind);
    auto t1 = std::chrono::steady_clock::now();
    runSeconds += stepSeconds, ++runSteps;
    double elapsed = std::chrono::duration<double>(t1 - start).count();
    std::printf("step %lld/%d  loss %.6f  %.0f %s/s  elapsed %.2fs\n", (long long)t, steps, loss,
                numRanks * batch * seq / stepSeconds, languageModel ? "tokens" : "examples", elapsed);
    if (t - first >= kWarmupSteps) {
      timedSeconds += stepSeconds;
      ++timedSteps;
    }
    std::fflush(stdout);
    if (!std::isfinite(loss) && !measuringAlone)
      fail(LOOM_INVALID_ARGUMENT, "the loss is ", loss, " at step ", t,
           "; lower --lr or raise --clip when compiling");
    if (saveEvery > 0 && t % saveEvery == 0) {
      ::mkdir(checkpointDir.c_str(), 0755);
      // ZeRO-1's master slices into whole masters, every rank at once (a collective).
      onEveryRank(ranks, comm, [](Session &rank) { rank.gatherParameters(); });
      for (size_t k = 0; k < ranks.size(); ++k) // every rank holds its own parts and state
        ranks[k]->saveCheckpoint(checkpointFile(checkpointDir, k));
      std::printf("saved %s at step %lld\n",
                  ranks.size() == 1 ? (checkpointDir + "/checkpoint.safetensors").c_str()
                                    : (checkpointDir + "/checkpoint.rank-*.safetensors").c_str(),
                  (long long)t);
    }
  }
  trainedStepSeconds = timedSteps > 0 ? timedSeconds / timedSteps : 0;
  if (stepTimes.on && stepTimes.timed > 0)
    stepTimes.report();
  if (timedSteps > 0)
    std::printf("trained: %.1f ms per step, %.0f %s/s (mean of %lld steps after %lld warm-up)\n",
                1e3 * timedSeconds / timedSteps, numRanks * batch * seq * timedSteps / timedSeconds,
                languageModel ? "tokens" : "examples",
                (long long)timedSteps, (long long)kWarmupSteps);
  // What the plan costs in GPU memory, beside what the compiler planned.
  for (size_t k = 0; k < ranks.size(); ++k)
    if (int64_t used = ranks[k]->deviceBytesInUse(); used >= 0)
      std::printf("device memory: rank %zu, GPU %d: %.2f GiB in use (arena %.2f GiB)\n", k, ranks[k]->cudaDevice(),
                  used / 1073741824.0, ranks[k]->rank().arenaBytes / 1073741824.0);
  return 0;
}

int run(int argc, char **argv) {
  std::string bundle, input, output, data, dataDtype = "uint16", checkpointDir, resume;
  std::string backend = "cpu", profilePath, tracePath;
  int steps = -1, threads = 0, saveEvery = 0;
  uint64_t seed = 0;
  double timeout = kDefaultTimeoutSeconds;
  GenerateOptions generation;
  bool generating = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (parseGenerateOption(argc, argv, i, generation)) {
      generating = true;
      continue;
    }
    auto value = [&]() -> std::string {
      if (i + 1 >= argc)
        fail(LOOM_INVALID_ARGUMENT, a, " needs a value");
      return argv[++i];
    };
    auto number = [&](long long max) -> long long {
      std::string v = value();
      char *end = nullptr;
      errno = 0;
      long long n = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end || n < 0)
        fail(LOOM_INVALID_ARGUMENT, a, " needs a non-negative integer, got '", v, "'");
      if (errno == ERANGE || n > max)
        fail(LOOM_INVALID_ARGUMENT, a, " must be at most ", max, ", got '", v, "'");
      return n;
    };
    constexpr long long kMaxInt = std::numeric_limits<int>::max();
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else if (a == "--input") {
      input = value();
    } else if (a == "--output") {
      output = value();
    } else if (a == "--steps") {
      steps = static_cast<int>(number(kMaxInt));
    } else if (a == "--threads") {
      threads = static_cast<int>(number(kMaxThreads));
    } else if (a == "--seed") {
      seed = static_cast<uint64_t>(number(std::numeric_limits<long long>::max()));
    } else if (a == "--timeout") {
      std::string v = value();
      char *end = nullptr;
      timeout = std::strtod(v.c_str(), &end);
      if (v.empty() || *end)
        fail(LOOM_INVALID_ARGUMENT, "--timeout needs a number of seconds, got '", v, "'");
      checkTimeout(timeout, "--timeout");
    } else if (a == "--deterministic") {
      setenv("LOOM_DETERMINISTIC", "1", 1); // read where the CUDA backend builds its kernels
    } else if (a == "--profile") {
      profilePath = value();
    } else if (a == "--trace") {
      tracePath = value();
    } else if (a == "--backend") {
      backend = value();
    } else if (a == "--data") {
      data = value();
    } else if (a == "--data-dtype") {
      dataDtype = value();
    } else if (a == "--save-every") {
      saveEvery = static_cast<int>(number(kMaxInt));
    } else if (a == "--checkpoint") {
      checkpointDir = value();
    } else if (a == "--resume") {
      resume = value();
    } else if (!a.empty() && a[0] == '-') {
      fail(LOOM_INVALID_ARGUMENT, "unknown option '", a, "' (see --help)");
    } else if (bundle.empty()) {
      bundle = a;
    } else {
      fail(LOOM_INVALID_ARGUMENT, "more than one bundle given ('", bundle, "' and '", a, "')");
    }
  }
  if (bundle.empty()) {
    usage(stderr);
    return 1;
  }

  SessionOptions options;
  options.threads = threads;
  options.backend = backend;
  options.timeoutSeconds = timeout;
  // Every rank of the bundle runs in this process, one thread each; under
  // mpirun, each process runs one rank and MPI connects them.
  Manifest manifest = readManifest(bundle);
  int64_t numRanks = static_cast<int64_t>(manifest.ranks.size());
  std::shared_ptr<Communicator> comm;
  std::vector<int64_t> local;
  if (launchedAsProcesses()) {
    if (threads == 0)
      options.threads = 1;
    reportLauncherSignals();
    int rank = joinProcessJob(manifest, bundle, options);
    comm = options.comm;
    processComm = comm.get();
    rankOfProcess = rank;
    ncclWorld = options.nccl.get();
    if (rank != 0) // rank 0 reports; the others speak only on error
      std::freopen("/dev/null", "w", stdout);
    local = {rank};
  } else if (const char *alone = std::getenv("LOOM_MEASURE_ONE_RANK"); alone && backend == "cuda" && numRanks > 1) {
    // A measurement only: one rank of the bundle on GPU 0, its collectives
    // local copies as for a group of one. It times a rank's own work (a
    // tensor-parallel rank's products at their partial widths, say) on a
    // machine with one GPU; its losses mean nothing.
    char *end = nullptr;
    long k = std::strtol(alone, &end, 10);
    if (end == alone || *end != '\0' || k < 0 || k >= numRanks) {
      std::fprintf(stderr, "loom-run: error: LOOM_MEASURE_ONE_RANK=%s: give a rank of the bundle, 0 to %lld\n", alone,
                   (long long)numRanks - 1);
      return 2;
    }
    std::fprintf(stderr, "loom-run: LOOM_MEASURE_ONE_RANK: rank %ld of %lld alone on GPU 0, its collectives local "
                         "copies: a measurement of its own work; the losses mean nothing\n", k, (long long)numRanks);
    local = {k};
    options.aloneForMeasurement = true;
  } else if (backend == "cuda" && numRanks > 1) {
    // One thread per GPU, rank k on GPU k, connected by NCCL.
    std::vector<int> devices;
    for (int64_t k = 0; k < numRanks; ++k)
      local.push_back(k), devices.push_back(static_cast<int>(k));
    options.nccl = makeNcclWorld(manifest, devices, -1, nullptr, timeout);
    ncclWorld = options.nccl.get();
  } else {
    for (int64_t k = 0; k < numRanks; ++k)
      local.push_back(k);
    if (numRanks > 1) {
      comm = std::make_shared<InProcessCommunicator>(static_cast<int>(numRanks), timeout);
      options.comm = comm;
      if (threads == 0)
        options.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency() / numRanks));
    }
  }
  // Ranks load (or initialise, then cut out their parts of) the weights
  // side by side: a 1.3B model takes a minute per rank on one core.
  std::vector<std::unique_ptr<Session>> ranks(local.size());
  {
    std::vector<std::thread> loaders;
    std::mutex mutex;
    std::optional<Error> failed;
    for (size_t i = 0; i < local.size(); ++i)
      loaders.emplace_back([&, i] {
        SessionOptions mine = options;
        mine.rank = static_cast<int>(local[i]);
        if (mine.nccl && !processComm)
          mine.device = static_cast<int>(local[i]);
        try {
          asError([&] { ranks[i] = std::make_unique<Session>(bundle, mine); });
        } catch (const Error &e) {
          std::lock_guard<std::mutex> lock(mutex);
          if (!failed)
            failed = Error(e.code, local.size() > 1 ? cat("rank ", local[i], ": ", e.what()) : e.what());
        }
      });
    for (std::thread &t : loaders)
      t.join();
    if (failed)
      throw *failed;
  }
  Session &s = *ranks[0];
  const RankProgram &r = s.rank();
  if (numRanks > 1) {
    const nlohmann::json &plan = s.manifest().plan;
    std::string shape;
    for (const char *axis : {"dp", "tp", "pp"})
      if (plan.contains(axis) && plan[axis].is_number_integer() && plan[axis].get<int64_t>() > 1)
        shape += cat(shape.empty() ? "" : " x ", axis, plan[axis].get<int64_t>());
    std::printf("%lld ranks (%s; %s)\n", (long long)numRanks,
                shape.empty() ? "data parallel" : shape.c_str(),
                processComm ? (launchedByMpi() ? "one process each, over MPI" : "one process each, over TCP")
                : ncclWorld ? "one GPU and thread each, over NCCL" : "threads in this process");
    if (std::string peers = ncclWorld ? describePeerLinks(*ncclWorld) : ""; !peers.empty())
      std::printf("gradient buckets over peer memory, copy engines moving the bytes: %s "
                  "(LOOM_CUDA_PEER_COLLECTIVES=0: NCCL's; LOOM_CUDA_PEER_ZERO=0: NCCL's for ZeRO)\n",
                  peers.c_str());
  }
  std::printf("%s: model %s, batch %lld, %zu parameter tensors, arena %.1f MiB (activations %.1f MiB), %s backend\n",
              bundle.c_str(), s.manifest().model.c_str(), (long long)s.manifest().batch, r.params.size(),
              r.arenaBytes / 1048576.0, r.peakActivationBytes / 1048576.0, s.backendName().c_str());
  if (!profilePath.empty())
    s.setProfiling(true);
  if (!tracePath.empty())
    for (auto &rank : ranks)
      rank->setTracing(true);
  // Every local rank's timeline, written once the runs are done.
  auto writeTrace = [&] {
    if (tracePath.empty())
      return;
    std::vector<RankTrace> traces;
    size_t events = 0;
    for (auto &rank : ranks) {
      RankTrace t;
      t.rank = rank->rank().rank;
      t.coords = std::map<std::string, int64_t>(rank->rank().coords.begin(), rank->rank().coords.end());
      t.events = rank->takeTrace();
      rank->setTracing(false);
      events += t.events.size();
      traces.push_back(std::move(t));
    }
    std::string path = tracePath;
    if (processComm) {
      size_t dot = path.rfind(".json");
      std::string tag = ".rank" + std::to_string(rankOfProcess.load());
      path = dot == std::string::npos ? path + tag : path.substr(0, dot) + tag + path.substr(dot);
    }
    writeChromeTrace(path, traces);
    std::printf("wrote %s: %zu events of %zu rank%s (open in ui.perfetto.dev)\n", path.c_str(), events,
                traces.size(), traces.size() == 1 ? "" : "s");
  };
  if (s.manifest().mode == "serve" || generating) {
    if (steps >= 0 || !input.empty() || !output.empty() || !data.empty() || saveEvery || !resume.empty())
      fail(LOOM_INVALID_ARGUMENT, "--steps, --input, --output, --data, --save-every and --resume do not apply "
           "to generation; see --help for the --generate options");
    generation.bundle = bundle;
    int rc = generate(ranks, generation, options);
    writeTrace();
    if (!profilePath.empty())
      reportProfile(s, profilePath);
    return rc;
  }
  if (s.canTrain()) {
    int rc = train(ranks, comm, steps < 0 ? 10 : steps, data, dataDtype, saveEvery, checkpointDir,
                   resume, seed);
    writeTrace();
    if (!profilePath.empty()) {
      // The step as it runs without events (CUDA graphs, no per-instruction
      // timing): 3 warm-up and 5 timed steps more, for the planner's calibration.
      double profiledSeconds = runSeconds;
      int64_t profiledSteps = runSteps;
      s.setProfiling(false);
      std::printf("timing 8 more steps without per-instruction events, for the calibration profile\n");
      train(ranks, comm, int(s.step()) + 8, data, dataDtype, 0, "", "", seed);
      runSeconds = profiledSeconds, runSteps = profiledSteps;
      reportProfile(s, profilePath, trainedStepSeconds);
    }
    return rc;
  }
  if (!data.empty() || saveEvery || !resume.empty())
    fail(LOOM_INVALID_ARGUMENT, "--data, --save-every and --resume need a training bundle "
         "(loomc compile --train)");
  if (steps < 0)
    steps = 1;

  // Every rank (the tensor-parallel parts of one model) sees the same inputs.
  for (auto &rank : ranks) {
    if (!input.empty()) {
      SafetensorsFile in = readSafetensors(input);
      for (const NamedBuffer &nb : r.inputs) {
        auto it = in.tensors.find(nb.name);
        if (it == in.tensors.end())
          fail(LOOM_INVALID_ARGUMENT, input, ": has no tensor for input '", nb.name, "'");
        const Buffer &b = r.buffers[nb.buffer];
        if (it->second.dtype != b.dtype || it->second.shape != b.shape)
          fail(LOOM_INVALID_ARGUMENT, input, ": input '", nb.name, "' is ", dtypeName(it->second.dtype),
               shapeStr(it->second.shape), " but the bundle expects ", dtypeName(b.dtype), shapeStr(b.shape));
        rank->bindInput(nb.name, in.data.data() + it->second.offset, it->second.bytes);
      }
    } else {
      std::mt19937_64 rng(seed);
      for (const NamedBuffer &nb : r.inputs)
        fillSynthetic(*rank, nb, rng);
    }
  }
  auto forwardAll = [&] { onEveryRank(ranks, comm, [](Session &rank) { rank.runForward(); }); };
  forwardAll(); // warm-up
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i)
    forwardAll();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  std::vector<SafetensorsTensorRef> refs;
  std::vector<std::vector<char>> copies;
  copies.reserve(r.outputs.size());
  for (const NamedBuffer &nb : r.outputs) {
    const Buffer &b = r.buffers[nb.buffer];
    copies.push_back(s.read(b));
    const char *p = copies.back().data();
    int64_t n = numElements(b.shape).value_or(0);
    double sum = 0, sq = 0, mn = INFINITY, mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
      double v = valueAt(b, p, i);
      sum += v, sq += v * v, mn = std::min(mn, v), mx = std::max(mx, v);
    }
    double mean = n ? sum / n : 0;
    std::printf("output %s: %s%s mean %.6g std %.6g min %.6g max %.6g first [", nb.name.c_str(),
                dtypeName(b.dtype), shapeStr(b.shape).c_str(), mean,
                std::sqrt(std::max(0.0, n ? sq / n - mean * mean : 0)), mn, mx);
    for (int64_t i = 0; i < std::min<int64_t>(n, 4); ++i)
      std::printf(i ? ", %.6g" : "%.6g", valueAt(b, p, i));
    std::printf("]\n");
    refs.push_back({nb.name, b.dtype, b.shape, p, static_cast<size_t>(b.bytes)});
  }
  if (steps > 0)
    std::printf("forward: %.3f ms per step over %d steps (after 1 warm-up)\n", ms / steps, steps);
  if (!output.empty()) {
    writeSafetensors(output, refs);
    std::printf("wrote %s\n", output.c_str());
  }
  writeTrace();
  if (!profilePath.empty())
    reportProfile(s, profilePath);
  return 0;
}
} // namespace

int main(int argc, char **argv) {
  std::string message;
  try {
    int rc = run(argc, argv);
    finalizeMpi();
    return rc;
  } catch (const std::bad_alloc &) {
    message = "out of host memory";
  } catch (const std::exception &e) {
    message = e.what();
  } catch (...) {
    message = "an exception that is not a std::exception";
  }
  if (!errorReported)
    std::fprintf(stderr, "loom-run: error: %s\n", message.c_str());
  if (processComm) // under a launcher: end the whole job, not just this process
    processComm->abort(rankOfProcess, message);
  return 1;
}
