//===- Engine.cpp - Continuous batching over a paged key/value cache ------===//

#include "runtime/src/serve/Engine.h"

#include "loom/rt/Error.h"

#include <algorithm>
#include <cstring>
#include <future>

namespace loom::rt::serve {

const char *finishName(Finish f) {
  switch (f) {
  case Finish::None:
    return "";
  case Finish::Length:
    return "length";
  case Finish::Stop:
    return "stop";
  case Finish::Cancelled:
    return "cancelled";
  case Finish::Error:
    return "error";
  }
  return "";
}

Engine::Engine(std::vector<Session *> sessions, EngineOptions opts) : ranks(std::move(sessions)), options(opts) {
  if (ranks.empty() || !ranks[0])
    fail(LOOM_INVALID_ARGUMENT, "serving needs the sessions of a bundle's ranks");
  cfg = ranks[0]->manifest().serve;
  if (!cfg.enabled())
    fail(LOOM_INVALID_ARGUMENT, "this bundle does not serve (mode '", ranks[0]->manifest().mode,
         "'); compile it with loomc compile --serve");
  if (ranks.size() != ranks[0]->manifest().ranks.size())
    fail(LOOM_INVALID_ARGUMENT, "serving needs all ", ranks[0]->manifest().ranks.size(),
         " ranks of the bundle, got ", ranks.size());
  for (int64_t b = cfg.numBlocks - 1; b >= 0; --b)
    freeBlocks.push_back(static_cast<int32_t>(b));
  counters.freeBlocks = counters.totalBlocks = cfg.numBlocks;
  if (!cfg.prepare.empty())
    for (Session *s : ranks)
      s->runProgram(cfg.prepare); // tensor-parallel prepares hold no collectives
}

Engine::~Engine() {
  try {
    stop(false);
  } catch (...) {
  }
}

uint64_t Engine::submit(std::vector<int32_t> prompt, const SamplingParams &params, TokenCallback callback) {
  auto refuse = [&](const std::string &why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++counters.refused;
    }
    fail(LOOM_INVALID_ARGUMENT, why);
  };
  if (prompt.empty())
    refuse("the prompt is empty");
  if (int64_t(prompt.size()) >= cfg.maxSeq)
    refuse(cat("the prompt has ", prompt.size(), " tokens; this bundle serves sequences of at most ", cfg.maxSeq,
               " (prompt and answer): shorten it or compile with a larger --max-seq"));
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= cfg.vocab)
      refuse(cat("prompt token ", i, " is ", prompt[i], ", outside the vocabulary [0, ", cfg.vocab, ")"));
  for (int32_t t : params.stopTokens)
    if (t < 0 || t >= cfg.vocab)
      refuse(cat("stop token ", t, " is outside the vocabulary [0, ", cfg.vocab, ")"));
  if (std::string e = checkSamplingParams(params); !e.empty())
    refuse(e);
  auto r = std::make_unique<Request>();
  r->promptLength = prompt.size();
  r->limit = std::min<size_t>(prompt.size() + size_t(params.maxNewTokens), size_t(cfg.maxSeq));
  int64_t blocks = (int64_t(r->limit) + cfg.blockSize - 1) / cfg.blockSize;
  if (blocks > cfg.numBlocks)
    refuse(cat("the request needs ", blocks, " cache blocks for ", r->limit, " tokens; the cache has ",
               cfg.numBlocks, ": ask for fewer new tokens or compile with more --kv-blocks"));
  r->tokens = std::move(prompt);
  r->params = params;
  r->sampler = std::make_unique<Sampler>(params);
  r->callback = std::make_shared<TokenCallback>(std::move(callback));
  std::lock_guard<std::mutex> lock(mu);
  if (stopping)
    fail(LOOM_RESOURCE_EXHAUSTED, "the server is shutting down");
  if (waiting.size() >= options.maxQueue) {
    ++counters.refused;
    fail(LOOM_RESOURCE_EXHAUSTED, "the queue is full (", options.maxQueue, " requests waiting); retry later");
  }
  r->id = nextId++;
  uint64_t id = r->id;
  ++counters.submitted;
  counters.promptTokens += r->tokens.size();
  waiting.push_back(std::move(r));
  counters.waiting = waiting.size();
  wake.notify_all();
  return id;
}

void Engine::cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu);
  cancelled.push_back(id);
  wake.notify_all();
}

void Engine::finish(Request &r, Finish why, const std::string &error, std::vector<Outgoing> &events) {
  for (int32_t b : r.blocks)
    freeBlocks.push_back(b);
  r.blocks.clear();
  if (!events.empty() && events.back().event.request == r.id && events.back().event.finish == Finish::None &&
      why != Finish::Error && why != Finish::Cancelled) {
    events.back().event.finish = why; // the last token ends it
    return;
  }
  TokenEvent e;
  e.request = r.id;
  e.index = static_cast<int32_t>(r.tokens.size() - r.promptLength);
  e.finish = why;
  e.error = error;
  events.push_back({e, r.callback});
}

/// Moves waiting requests into the batch while there is a slot and the
/// cache holds their longest answer; in arrival order, so none starves.
void Engine::admit() {
  std::vector<Outgoing> events;
  std::vector<std::unique_ptr<Request>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (uint64_t id : cancelled) {
      auto w = std::find_if(waiting.begin(), waiting.end(), [&](auto &r) { return r->id == id; });
      if (w != waiting.end()) {
        dropped.push_back(std::move(*w));
        waiting.erase(w);
        continue;
      }
      auto q = std::find_if(running.begin(), running.end(), [&](auto &r) { return r->id == id; });
      if (q != running.end()) {
        dropped.push_back(std::move(*q));
        running.erase(q);
      }
    }
    cancelled.clear();
    while (!waiting.empty() && int64_t(running.size()) < cfg.maxBatch) {
      Request &r = *waiting.front();
      size_t need = (r.limit + size_t(cfg.blockSize) - 1) / size_t(cfg.blockSize);
      if (need > freeBlocks.size())
        break;
      for (size_t i = 0; i < need; ++i) {
        r.blocks.push_back(freeBlocks.back());
        freeBlocks.pop_back();
      }
      running.push_back(std::move(waiting.front()));
      waiting.pop_front();
    }
    counters.cancelled += dropped.size();
    counters.waiting = waiting.size();
  }
  for (auto &r : dropped)
    finish(*r, Finish::Cancelled, "", events);
  deliver(events);
}

bool Engine::step() {
  admit();
  if (running.empty()) {
    std::lock_guard<std::mutex> lock(mu);
    counters.running = 0;
    counters.freeBlocks = int64_t(freeBlocks.size());
    return false;
  }
  // Decoding sequences first, one token each; then prompt chunks fill the
  // largest program's remaining token slots.
  const int64_t budget = cfg.programs.back().tokens;
  std::vector<Planned> plan;
  int64_t used = 0, rows = 0;
  for (auto &r : running)
    if (r->computed >= r->promptLength) {
      plan.push_back({r.get(), 1, rows++});
      ++used;
    }
  for (auto &r : running)
    if (r->computed < r->promptLength && used < budget) {
      size_t left = r->tokens.size() - r->computed;
      size_t count = std::min<size_t>(left, size_t(budget - used));
      bool last = count == left;
      plan.push_back({r.get(), count, last ? rows++ : -1});
      used += int64_t(count);
    }
  const ServeProgram *program = &cfg.programs.back();
  for (const ServeProgram &p : cfg.programs)
    if (p.tokens >= used && p.rows >= rows) {
      program = &p;
      break;
    }
  std::vector<Outgoing> events;
  try {
    runStep(*program, plan, events);
  } catch (const Error &e) {
    // A failed step leaves the cache of every request in it unknown: end
    // them all with the reason rather than go on with wrong tokens.
    for (auto &r : running)
      finish(*r, Finish::Error, e.what(), events);
    running.clear();
  }
  // Requests that finished leave the batch; their blocks went back.
  std::vector<std::unique_ptr<Request>> still;
  std::set<uint64_t> ended;
  for (const Outgoing &o : events)
    if (o.event.finish != Finish::None)
      ended.insert(o.event.request);
  for (auto &r : running)
    if (!ended.count(r->id))
      still.push_back(std::move(r));
  running = std::move(still);
  {
    std::lock_guard<std::mutex> lock(mu);
    ++counters.steps;
    counters.finished += ended.size();
    for (const Outgoing &o : events)
      counters.generatedTokens += o.event.token >= 0;
    counters.running = running.size();
    counters.freeBlocks = int64_t(freeBlocks.size());
  }
  deliver(events);
  return true;
}

void Engine::runStep(const ServeProgram &p, const std::vector<Planned> &plan, std::vector<Outgoing> &events) {
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  double inputs = 0; // the slowest rank's: each binds its own, at once
  std::mutex inputsMu;
  const int64_t n = p.tokens, perSeq = cfg.maxBlocksPerSeq, bs = cfg.blockSize;
  std::vector<int32_t> tokens(size_t(n), 0), positions(size_t(n), 0), slots(size_t(n), -1);
  std::vector<int32_t> table(size_t(n * perSeq), 0), rows(size_t(p.rows), 0);
  int64_t at = 0;
  for (const Planned &pl : plan) {
    Request &r = *pl.request;
    for (size_t k = 0; k < pl.count; ++k, ++at) {
      size_t pos = r.computed + k;
      tokens[at] = r.tokens[pos];
      positions[at] = static_cast<int32_t>(pos);
      slots[at] = r.blocks[pos / size_t(bs)] * int32_t(bs) + int32_t(pos % size_t(bs));
      std::copy(r.blocks.begin(), r.blocks.end(), table.begin() + at * perSeq);
    }
    if (pl.row >= 0)
      rows[pl.row] = static_cast<int32_t>(at - 1);
  }
  auto bind = [&](Session &s, const char *name, const std::vector<int32_t> &v) {
    s.bindInputBeforeRun(p.name + "." + name, v.data(), v.size() * sizeof(int32_t));
  };
  auto run = [&](Session &s) {
    auto b0 = Clock::now();
    bind(s, "tokens", tokens);
    bind(s, "positions", positions);
    bind(s, "slots", slots);
    bind(s, "block_table", table);
    bind(s, "rows", rows);
    {
      std::lock_guard<std::mutex> lock(inputsMu);
      inputs = std::max(inputs, std::chrono::duration<double>(Clock::now() - b0).count());
    }
    s.runProgram(p.name);
  };
  if (ranks.size() == 1) {
    run(*ranks[0]);
  } else {
    // Every rank runs the step at once (their collectives meet).
    std::vector<std::future<void>> done;
    for (Session *s : ranks)
      done.push_back(std::async(std::launch::async, [&, s] { run(*s); }));
    std::exception_ptr first;
    for (auto &f : done)
      try {
        f.get();
      } catch (...) {
        if (!first)
          first = std::current_exception();
      }
    if (first)
      std::rethrow_exception(first);
  }
  auto t1 = Clock::now();
  // The logits of the sampled rows, as f32.
  const Buffer &out = ranks[0]->output(p.name + ".logits");
  const int64_t V = cfg.vocab, sampled = std::count_if(plan.begin(), plan.end(), [](auto &x) { return x.row >= 0; });
  // Greedy rows need only their argmax: the device finds it, and the step
  // reads back a token per row instead of rows of vocab logits.
  bool greedy = !options.eventLogits && std::all_of(plan.begin(), plan.end(), [](const Planned &x) {
    return x.row < 0 || (x.request->params.temperature == 0 && x.request->params.repetitionPenalty == 1);
  });
  if (greedy) {
    argmax.resize(size_t(sampled));
    ranks[0]->argmaxRows(out, sampled, V, argmax.data());
  } else {
    raw = ranks[0]->read(out);
    logits.resize(size_t(sampled * V));
    for (int64_t i = 0; i < sampled * V; ++i)
      logits[i] = out.dtype == LOOM_BF16 ? bf16ToFloat(reinterpret_cast<const uint16_t *>(raw.data())[i])
                                         : reinterpret_cast<const float *>(raw.data())[i];
  }
  auto t2 = Clock::now();
  for (const Planned &pl : plan) {
    Request &r = *pl.request;
    r.computed += pl.count;
    if (pl.row < 0)
      continue;
    int32_t token = greedy ? argmax[size_t(pl.row)] : r.sampler->next(logits.data() + pl.row * V, V, r.tokens);
    r.tokens.push_back(token);
    TokenEvent e;
    e.request = r.id;
    e.token = token;
    e.index = static_cast<int32_t>(r.tokens.size() - r.promptLength - 1);
    if (!greedy)
      e.logits = logits.data() + pl.row * V, e.vocab = V;
    events.push_back({e, r.callback});
    const auto &stops = r.params.stopTokens;
    if (std::find(stops.begin(), stops.end(), token) != stops.end())
      finish(r, Finish::Stop, "", events);
    else if (r.tokens.size() >= r.limit)
      finish(r, Finish::Length, "", events);
  }
  auto t3 = Clock::now();
  auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };
  std::lock_guard<std::mutex> lock(mu);
  counters.inputSeconds += inputs;
  counters.programSeconds += secs(t1 - t0) - inputs;
  counters.logitsSeconds += secs(t2 - t1);
  counters.sampleSeconds += secs(t3 - t2);
}

void Engine::deliver(std::vector<Outgoing> &events) {
  for (const Outgoing &o : events) {
    // Callbacks are the embedder's: one that throws must not stop the others.
    try {
      if (o.callback && *o.callback)
        (*o.callback)(o.event);
    } catch (...) {
    }
  }
}

void Engine::loop() {
  for (;;) {
    bool worked = false;
    try {
      worked = step();
    } catch (...) {
      // step() ends the requests of a failed step itself; nothing else throws.
    }
    std::unique_lock<std::mutex> lock(mu);
    if (stopping && (!draining || (waiting.empty() && running.empty() && cancelled.empty())))
      return;
    if (!worked)
      wake.wait_for(lock, std::chrono::milliseconds(50),
                    [&] { return stopping || !waiting.empty() || !cancelled.empty(); });
  }
}

void Engine::start() {
  std::lock_guard<std::mutex> lock(mu);
  if (worker.joinable())
    return;
  stopping = draining = false;
  worker = std::thread([this] { loop(); });
}

void Engine::stop(bool drain) {
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
    draining = drain;
    wake.notify_all();
  }
  if (worker.joinable())
    worker.join();
  // Whatever is left (not drained, or never started) is cancelled.
  std::vector<Outgoing> events;
  std::deque<std::unique_ptr<Request>> left;
  {
    std::lock_guard<std::mutex> lock(mu);
    left.swap(waiting);
    cancelled.clear();
    counters.waiting = 0;
  }
  for (auto &r : running)
    left.push_back(std::move(r));
  running.clear();
  for (auto &r : left)
    finish(*r, Finish::Cancelled, "", events);
  {
    std::lock_guard<std::mutex> lock(mu);
    counters.cancelled += left.size();
    counters.running = 0;
    counters.freeBlocks = int64_t(freeBlocks.size());
  }
  deliver(events);
}

void Engine::runUntilIdle() {
  for (;;) {
    bool worked = step();
    std::lock_guard<std::mutex> lock(mu);
    if (!worked && waiting.empty() && running.empty())
      return;
  }
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu);
  return counters;
}

} // namespace loom::rt::serve
