//===- CApiServe.cpp - The C API's server over the serving engine ---------===//

#include "loom/runtime.h"
#include "runtime/src/CApiStatus.h"
#include "runtime/src/LocalRanks.h"
#include "runtime/src/ThreadPool.h"
#include "runtime/src/serve/Engine.h"

#include <memory>
#include <mutex>

using loom::rt::capi::guarded;
using loom::rt::capi::nullArgument;

struct loom_server_t {
  std::string bundlePath;
  std::vector<std::unique_ptr<loom::rt::Session>> ranks;
  std::unique_ptr<loom::rt::serve::Engine> engine;
  // The bundle's tokenizer, read when first asked for (most servers take ids).
  std::mutex tokenizerMutex;
  bool tokenizerRead = false;
  std::unique_ptr<loom_tokenizer_t, void (*)(loom_tokenizer_t *)> tokenizer{nullptr, loom_tokenizer_destroy};
};

static_assert(int(loom::rt::serve::Finish::Length) == LOOM_FINISH_LENGTH &&
                  int(loom::rt::serve::Finish::Stop) == LOOM_FINISH_STOP &&
                  int(loom::rt::serve::Finish::Cancelled) == LOOM_FINISH_CANCELLED &&
                  int(loom::rt::serve::Finish::Error) == LOOM_FINISH_ERROR,
              "the C API's finish reasons are the engine's");

namespace {

/// A caller's struct of an older (smaller) or unknown size is refused
/// rather than read past its end.
void checkSize(size_t given, size_t least, const char *what) {
  if (given < least)
    loom::rt::fail(LOOM_INVALID_ARGUMENT, what, ".struct_size is ", given, "; fill it with ", what,
                   "'s init function first");
}

} // namespace

extern "C" {

void loom_server_options_init(loom_server_options_t *options) {
  if (options) {
    options->struct_size = sizeof(*options);
    options->backend = "cpu";
    options->num_threads = 0;
    options->max_queue = 1024;
  }
}

void loom_sampling_params_init(loom_sampling_params_t *params) {
  if (params) {
    params->struct_size = sizeof(*params);
    params->temperature = 0;
    params->top_k = 0;
    params->top_p = 1;
    params->repetition_penalty = 1;
    params->seed = 0;
    params->max_new_tokens = 16;
    params->stop_tokens = nullptr;
    params->num_stop_tokens = 0;
  }
}

void loom_server_stats_init(loom_server_stats_t *stats) {
  if (stats) {
    *stats = loom_server_stats_t{};
    stats->struct_size = sizeof(*stats);
  }
}

loom_status_t *loom_server_create(const char *bundle_path, const loom_server_options_t *options,
                                  loom_server_t **out_server) {
  if (!bundle_path)
    return nullArgument("bundle_path");
  if (!out_server)
    return nullArgument("out_server");
  *out_server = nullptr;
  return guarded([&] {
    loom::rt::SessionOptions opts;
    loom::rt::serve::EngineOptions engineOptions;
    if (options) {
      checkSize(options->struct_size, sizeof(loom_server_options_t), "loom_server_options_t");
      if (options->backend)
        opts.backend = options->backend;
      loom::rt::capi::checkNumThreads(options->num_threads);
      opts.threads = options->num_threads;
      if (options->max_queue < 1)
        loom::rt::fail(LOOM_INVALID_ARGUMENT, "options.max_queue must be at least 1, got ", options->max_queue);
      engineOptions.maxQueue = size_t(options->max_queue);
    }
    auto server = std::make_unique<loom_server_t>();
    server->bundlePath = bundle_path;
    server->ranks = loom::rt::openLocalRanks(bundle_path, opts);
    std::vector<loom::rt::Session *> sessions;
    for (auto &s : server->ranks)
      sessions.push_back(s.get());
    server->engine = std::make_unique<loom::rt::serve::Engine>(sessions, engineOptions);
    server->engine->start();
    *out_server = server.release();
  });
}

void loom_server_destroy(loom_server_t *server) {
  if (!server)
    return;
  if (server->engine)
    server->engine->stop(false);
  delete server;
}

loom_status_t *loom_server_submit(loom_server_t *server, const int32_t *tokens, size_t num_tokens,
                                  const loom_sampling_params_t *params, loom_token_callback_t callback,
                                  void *user_data, uint64_t *out_request) {
  if (!server)
    return nullArgument("server");
  if (!tokens && num_tokens > 0)
    return nullArgument("tokens");
  if (!callback)
    return nullArgument("callback");
  return guarded([&] {
    loom::rt::serve::SamplingParams p;
    if (params) {
      checkSize(params->struct_size, sizeof(loom_sampling_params_t), "loom_sampling_params_t");
      p.temperature = params->temperature;
      p.topK = params->top_k;
      p.topP = params->top_p;
      p.repetitionPenalty = params->repetition_penalty;
      p.seed = params->seed;
      p.maxNewTokens = params->max_new_tokens;
      if (params->num_stop_tokens < 0 || (params->num_stop_tokens > 0 && !params->stop_tokens))
        loom::rt::fail(LOOM_INVALID_ARGUMENT, "params.stop_tokens must hold num_stop_tokens (",
                       params->num_stop_tokens, ") ids");
      p.stopTokens.assign(params->stop_tokens, params->stop_tokens + params->num_stop_tokens);
    }
    std::vector<int32_t> prompt(tokens, tokens + num_tokens);
    uint64_t id = server->engine->submit(std::move(prompt), p, [callback, user_data](const loom::rt::serve::TokenEvent &e) {
      loom_token_event_t event{};
      event.request = e.request;
      event.token = e.token;
      event.index = e.index;
      event.finish = static_cast<loom_finish_reason_t>(e.finish);
      event.error = e.error.c_str();
      callback(&event, user_data);
    });
    if (out_request)
      *out_request = id;
  });
}

loom_status_t *loom_server_cancel(loom_server_t *server, uint64_t request) {
  if (!server)
    return nullArgument("server");
  return guarded([&] { server->engine->cancel(request); });
}

loom_status_t *loom_server_drain(loom_server_t *server) {
  if (!server)
    return nullArgument("server");
  return guarded([&] { server->engine->stop(true); });
}

loom_status_t *loom_server_tokenizer(loom_server_t *server, const loom_tokenizer_t **out_tokenizer) {
  if (!server)
    return nullArgument("server");
  if (!out_tokenizer)
    return nullArgument("out_tokenizer");
  *out_tokenizer = nullptr;
  std::lock_guard<std::mutex> lock(server->tokenizerMutex);
  if (!server->tokenizerRead && !server->ranks.front()->manifest().tokenizer.empty()) {
    loom_tokenizer_t *tokenizer = nullptr;
    if (loom_status_t *status = loom_tokenizer_create(server->bundlePath.c_str(), &tokenizer))
      return status;
    server->tokenizer.reset(tokenizer);
  }
  server->tokenizerRead = true;
  *out_tokenizer = server->tokenizer.get();
  return nullptr;
}

loom_status_t *loom_server_stats(const loom_server_t *server, loom_server_stats_t *out) {
  if (!server)
    return nullArgument("server");
  if (!out)
    return nullArgument("out_stats");
  return guarded([&] {
    checkSize(out->struct_size, sizeof(loom_server_stats_t), "loom_server_stats_t");
    loom::rt::serve::EngineStats s = server->engine->stats();
    out->submitted = s.submitted, out->finished = s.finished, out->refused = s.refused;
    out->cancelled = s.cancelled, out->prompt_tokens = s.promptTokens;
    out->generated_tokens = s.generatedTokens, out->steps = s.steps;
    out->waiting = s.waiting, out->running = s.running;
    out->free_blocks = s.freeBlocks, out->total_blocks = s.totalBlocks;
  });
}

} // extern "C"
