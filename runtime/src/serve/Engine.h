//===- Engine.h - Continuous batching over a paged key/value cache -*- C++ -*-===//
//
// The runtime side of serving. A serving bundle (loomc compile --serve) has
// step programs over N token slots and a paged key/value cache; the engine
// schedules requests onto them: between two steps requests join (their
// prompt in chunks, so that a long prompt does not stall the sequences
// already decoding) and leave (their cache blocks return to the pool).
// A request reserves the blocks for its prompt and its longest answer when
// it is admitted, so a running request never runs out of cache; one that
// cannot fit yet waits, and one that can never fit is refused.
//
// Thread-safe: submit and cancel from any thread; steps run on the engine's
// own thread (start) or on the caller's (step). Callbacks run on the
// stepping thread, without the engine's lock held: they may submit and
// cancel, and should return quickly.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_SERVE_ENGINE_H
#define LOOM_RUNTIME_SERVE_ENGINE_H

#include "runtime/src/Session.h"
#include "runtime/src/serve/Sampler.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

namespace loom::rt::serve {

enum class Finish { None, Length, Stop, Cancelled, Error };
/// "length", "stop", "cancelled", "error" ("" for None): OpenAI's finish_reason words.
const char *finishName(Finish f);

/// One produced token, or the end of a request.
struct TokenEvent {
  uint64_t request = 0;
  int32_t token = -1;     // -1 on an event that only ends the request
  int32_t index = 0;      // of the token among the request's new tokens
  Finish finish = Finish::None; // not None on the request's last event
  std::string error;      // why, when finish is Error
  /// The logits the token was sampled from (vocab of them), valid during
  /// the callback; null on an event without a token, and unless the
  /// engine was asked for them (EngineOptions::eventLogits).
  const float *logits = nullptr;
  int64_t vocab = 0;
};
using TokenCallback = std::function<void(const TokenEvent &)>;

struct EngineOptions {
  /// Requests waiting for a slot at most; more are refused (the HTTP
  /// server answers 429).
  size_t maxQueue = 1024;
  /// Hand each token's logits to its callback (TokenEvent::logits). Off,
  /// a step whose sampled rows are all greedy reads back only their argmax
  /// (computed on the device) instead of whole rows of logits.
  bool eventLogits = false;
};

struct EngineStats {
  uint64_t submitted = 0, finished = 0, refused = 0, cancelled = 0;
  uint64_t promptTokens = 0, generatedTokens = 0, steps = 0;
  size_t waiting = 0, running = 0;
  int64_t freeBlocks = 0, totalBlocks = 0;
  /// Where the steps' time went on the stepping thread: handing the step's
  /// tokens, positions and block table to the ranks, running the program,
  /// reading the sampled rows' logits back, and sampling.
  double inputSeconds = 0, programSeconds = 0, logitsSeconds = 0, sampleSeconds = 0;
};

class Engine {
public:
  /// Serves the bundle that `ranks` (one session per rank, in rank order,
  /// all of one serving bundle) run; the logits are read from rank 0. Runs
  /// the bundle's prepare program. Throws Error for a bundle that does not
  /// serve.
  Engine(std::vector<Session *> ranks, EngineOptions options = {});
  ~Engine();
  Engine(const Engine &) = delete;
  Engine &operator=(const Engine &) = delete;

  const ServeConfig &config() const { return cfg; }

  /// Queues a request and returns its id. Throws Error: LOOM_INVALID_ARGUMENT
  /// for a request that can never run (empty prompt, a token outside the
  /// vocabulary, a prompt of max_seq tokens or more, bad sampling
  /// parameters), LOOM_RESOURCE_EXHAUSTED when the queue is full.
  uint64_t submit(std::vector<int32_t> prompt, const SamplingParams &params, TokenCallback callback);
  /// Ends a request: its callback gets a last event with Finish::Cancelled
  /// (unless it already finished). Unknown ids are ignored.
  void cancel(uint64_t id);

  /// One step on the calling thread: admits waiting requests, runs one
  /// program, delivers its tokens. False when there was nothing to do.
  /// Not to be called while the engine's thread runs.
  bool step();
  /// Steps on a thread of the engine's own until stop().
  void start();
  /// Stops the thread. With `drain`, first lets every queued and running
  /// request finish; without, cancels them.
  void stop(bool drain);
  /// Runs steps on the calling thread until no request is left.
  void runUntilIdle();

  EngineStats stats() const;

private:
  struct Request {
    uint64_t id = 0;
    std::vector<int32_t> tokens; // prompt, then generated
    size_t promptLength = 0;
    size_t computed = 0;         // tokens whose keys and values are cached
    size_t limit = 0;            // tokens it may reach (prompt + max new, at most max_seq)
    std::vector<int32_t> blocks;
    SamplingParams params;
    std::unique_ptr<Sampler> sampler;
    std::shared_ptr<TokenCallback> callback;
  };
  /// An event and whom to tell, delivered after the step's bookkeeping.
  struct Outgoing {
    TokenEvent event;
    std::shared_ptr<TokenCallback> callback;
  };
  struct Planned {
    Request *request;
    size_t count;  // tokens of this request in the step
    int64_t row;   // its sampled row, -1 when it samples nothing this step
  };

  void admit();
  void finish(Request &r, Finish why, const std::string &error, std::vector<Outgoing> &events);
  void runStep(const ServeProgram &p, const std::vector<Planned> &plan, std::vector<Outgoing> &events);
  void deliver(std::vector<Outgoing> &events);
  void loop();

  std::vector<Session *> ranks;
  ServeConfig cfg;
  EngineOptions options;
  std::vector<int32_t> freeBlocks;

  mutable std::mutex mu;
  std::condition_variable wake;
  std::deque<std::unique_ptr<Request>> waiting;  // guarded by mu
  std::vector<uint64_t> cancelled;               // guarded by mu
  EngineStats counters;                          // guarded by mu
  uint64_t nextId = 1;                           // guarded by mu
  std::vector<std::unique_ptr<Request>> running; // the stepping thread's
  std::vector<float> logits;                     // scratch, the stepping thread's
  std::vector<char> raw;
  std::vector<int32_t> argmax;                   // scratch: greedy rows' tokens

  std::thread worker;
  bool stopping = false, draining = false; // guarded by mu
};

} // namespace loom::rt::serve

#endif
