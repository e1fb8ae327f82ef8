//===- loom-serve.cpp - An HTTP server over the serving engine ------------===//
//
// loom-serve BUNDLE --port P: OpenAI-style completions over token ids
// (POST /v1/completions, streamed as server-sent events or answered whole),
// GET /health and GET /metrics (Prometheus). The engine steps on its own
// thread; each HTTP handler submits its request and waits on the request's
// own queue of tokens. A streaming client that goes away cancels its request,
// so that its cache blocks return at once. SIGTERM or SIGINT: new requests
// get 503, the ones in flight finish, then the process exits 0.
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Error.h"
#include "loom/rt/Tokenizer.h"
#include "runtime/src/LocalRanks.h"
#include "runtime/src/serve/Engine.h"
#include "runtime/tools/ServeMetrics.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <optional>
#include <cstdio>
#include <cstring>
#include <unistd.h>

namespace loom::rt {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr size_t kMaxBodyBytes = 1 << 20;

/// JSON text of `v`; bytes that are not UTF-8 (a random model's answer can
/// decode to any bytes) become U+FFFD rather than an exception.
std::string dumpJson(const json &v) { return v.dump(-1, ' ', false, json::error_handler_t::replace); }

/// A bad request: answered 400 with its message.
struct BadRequest : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// What the engine produced for one request, handed from the engine's thread
/// to the handler's.
struct Pending {
  std::mutex mu;
  std::condition_variable ready;
  std::deque<int32_t> fresh; // not yet sent (streaming)
  std::vector<int32_t> tokens;
  serve::Finish finish = serve::Finish::None;
  std::string error;
  Clock::time_point submitted = Clock::now(), last;
  /// With a tokenizer, when streaming: the text of the tokens as they arrive
  /// (the streaming handler's thread only).
  std::unique_ptr<Tokenizer::StreamDecoder> text;
};

struct CompletionRequest {
  std::vector<int32_t> prompt;
  serve::SamplingParams params;
  bool stream = false;
};

int32_t tokenId(const json &v, const char *what) {
  if (!v.is_number_integer())
    throw BadRequest(std::string(what) + " must be token ids (integers)");
  int64_t t = v.get<int64_t>();
  if (t < INT32_MIN || t > INT32_MAX)
    throw BadRequest(std::string(what) + " has " + std::to_string(t) + ", not a token id");
  return int32_t(t);
}

/// `tokenizer`: the bundle's, or null (then prompts are token ids only).
CompletionRequest parseCompletion(const std::string &body, const Tokenizer *tokenizer) {
  json doc = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded())
    throw BadRequest("the body is not valid JSON");
  if (!doc.is_object())
    throw BadRequest("the body must be a JSON object");
  CompletionRequest r;
  if (!doc.contains("prompt"))
    throw BadRequest(tokenizer ? "'prompt' is required (text, or an array of token ids)"
                               : "'prompt' is required (an array of token ids)");
  const json &prompt = doc["prompt"];
  if (prompt.is_string()) {
    if (!tokenizer)
      throw BadRequest("this bundle has no tokenizer; send token ids");
    try {
      r.prompt = tokenizer->promptIds(prompt.get<std::string>());
    } catch (const Error &e) {
      throw BadRequest(std::string("'prompt' cannot be encoded: ") + e.what());
    }
    if (r.prompt.empty())
      throw BadRequest("'prompt' is empty");
  } else if (!prompt.is_array()) {
    throw BadRequest(tokenizer ? "'prompt' must be text or an array of token ids"
                               : "'prompt' must be an array of token ids");
  } else {
    for (const json &t : prompt)
      r.prompt.push_back(tokenId(t, "'prompt'"));
  }
  auto number = [&](const char *key, double lo, double hi, bool whole) -> std::optional<double> {
    if (!doc.contains(key) || doc[key].is_null())
      return std::nullopt;
    const json &v = doc[key];
    if (!v.is_number() || (whole && !v.is_number_integer()))
      throw BadRequest(std::string("'") + key + "' must be " + (whole ? "an integer" : "a number"));
    double d = v.get<double>();
    if (!(d >= lo && d <= hi))
      throw BadRequest(std::string("'") + key + "' must be in [" + json(lo).dump() + ", " + json(hi).dump() +
                       "], got " + v.dump());
    return d;
  };
  serve::SamplingParams &p = r.params;
  if (auto v = number("max_tokens", 1, 1e9, true))
    p.maxNewTokens = int32_t(*v);
  if (auto v = number("temperature", 0, 1e6, false))
    p.temperature = float(*v);
  if (auto v = number("top_p", 1e-9, 1, false))
    p.topP = float(*v);
  if (auto v = number("top_k", 0, 1e9, true))
    p.topK = int32_t(*v);
  if (auto v = number("repetition_penalty", 1e-6, 1e6, false))
    p.repetitionPenalty = float(*v);
  if (auto v = number("seed", 0, 9e15, true))
    p.seed = uint64_t(*v);
  if (doc.contains("stop") && !doc["stop"].is_null()) {
    const json &stop = doc["stop"];
    if (stop.is_array())
      for (const json &t : stop)
        p.stopTokens.push_back(tokenId(t, "'stop'"));
    else
      p.stopTokens.push_back(tokenId(stop, "'stop'"));
  }
  auto flag = [&](const char *key) {
    if (!doc.contains(key) || doc[key].is_null())
      return false;
    if (!doc[key].is_boolean())
      throw BadRequest(std::string("'") + key + "' must be true or false");
    return doc[key].get<bool>();
  };
  r.stream = flag("stream");
  // With a tokenizer, a generation ends at its end-of-sequence token as the
  // model's own tokenizer defines it, unless asked not to.
  if (tokenizer && tokenizer->eosId() && !flag("ignore_eos"))
    p.stopTokens.push_back(*tokenizer->eosId());
  return r;
}

void answerError(httplib::Response &res, int status, const std::string &message) {
  res.status = status;
  res.set_content(dumpJson(json{{"error", {{"message", message}, {"code", status}}}}) + "\n", "application/json");
}

class Server {
public:
  Server(serve::Engine &engine, std::string model, std::unique_ptr<Tokenizer> tokenizer)
      : engine(engine), model(std::move(model)), tokenizer(std::move(tokenizer)) {}

  void install(httplib::Server &http) {
    http.Post("/v1/completions", [this](const httplib::Request &req, httplib::Response &res) {
      complete(req, res);
      metrics.response(res.status == -1 ? 200 : res.status); // httplib sets 200 after the handler
    });
    http.Get("/health", [this](const httplib::Request &, httplib::Response &res) {
      bool d = draining.load();
      res.status = d ? 503 : 200;
      res.set_content(json{{"status", d ? "draining" : "ok"}}.dump() + "\n", "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request &, httplib::Response &res) {
      res.set_content(metrics.render(engine.stats(), draining.load()), "text/plain; version=0.0.4");
    });
    // Unknown paths, oversized bodies (413) and the like: an error body of
    // the same shape as the handlers' own.
    http.set_error_handler([this](const httplib::Request &req, httplib::Response &res) {
      if (!res.body.empty())
        return;
      std::string why = res.status == 404   ? "no such endpoint: " + req.method + " " + req.path
                        : res.status == 413 ? "the body is larger than " + std::to_string(kMaxBodyBytes) + " bytes"
                                            : "request failed";
      answerError(res, res.status, why);
      metrics.response(res.status);
    });
    http.set_exception_handler([this](const httplib::Request &, httplib::Response &res, std::exception_ptr e) {
      std::string why = "internal error";
      try {
        std::rethrow_exception(e);
      } catch (const std::exception &x) {
        why = x.what();
      } catch (...) {
      }
      answerError(res, 500, why);
      metrics.response(500);
    });
  }

  /// From now on new requests get 503; those in flight go on.
  void beginDrain() { draining = true; }

  /// Waits until every stream has written its last event: httplib ends
  /// streams unfinished once it stops. False after `timeout`.
  bool waitForStreams(std::chrono::seconds timeout) {
    std::unique_lock<std::mutex> lock(streamsMu);
    return streamsDone.wait_for(lock, timeout, [&] { return openStreams == 0; });
  }

private:
  void complete(const httplib::Request &req, httplib::Response &res) {
    if (draining) {
      answerError(res, 503, "the server is shutting down");
      return;
    }
    CompletionRequest c;
    try {
      c = parseCompletion(req.body, tokenizer.get());
    } catch (const BadRequest &e) {
      answerError(res, 400, e.what());
      return;
    }
    auto pending = std::make_shared<Pending>();
    if (tokenizer && c.stream)
      pending->text = std::make_unique<Tokenizer::StreamDecoder>(*tokenizer);
    uint64_t id = 0;
    try {
      id = engine.submit(c.prompt, c.params, [this, pending](const serve::TokenEvent &e) { deliver(*pending, e); });
    } catch (const Error &e) {
      int status = e.code == LOOM_RESOURCE_EXHAUSTED ? (draining ? 503 : 429)
                   : e.code == LOOM_INVALID_ARGUMENT ? 400
                                                     : 500;
      answerError(res, status, e.what());
      return;
    }
    std::string name = "cmpl-" + std::to_string(id);
    size_t promptTokens = c.prompt.size();
    if (!c.stream) {
      std::unique_lock<std::mutex> lock(pending->mu);
      pending->ready.wait(lock, [&] { return pending->finish != serve::Finish::None; });
      if (pending->finish == serve::Finish::Error || pending->finish == serve::Finish::Cancelled) {
        answerError(res, 500, pending->finish == serve::Finish::Error ? "generation failed: " + pending->error
                                                                      : "the request was cancelled");
        return;
      }
      json choice = {{"index", 0}, {"tokens", pending->tokens}, {"finish_reason", serve::finishName(pending->finish)}};
      if (tokenizer)
        choice["text"] = tokenizer->decode(pending->tokens);
      json body = {{"id", name},
                   {"object", "text_completion"},
                   {"model", model},
                   {"choices", json::array({choice})},
                   {"usage",
                    {{"prompt_tokens", promptTokens},
                     {"completion_tokens", pending->tokens.size()},
                     {"total_tokens", promptTokens + pending->tokens.size()}}}};
      res.set_content(dumpJson(body) + "\n", "application/json");
      return;
    }
    res.set_header("Cache-Control", "no-cache");
    {
      std::lock_guard<std::mutex> lock(streamsMu);
      ++openStreams;
    }
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, pending, id, name, promptTokens](size_t, httplib::DataSink &sink) {
          return streamSome(*pending, id, name, promptTokens, sink);
        },
        [this, pending, id](bool) {
          {
            // Ended before the last event (the client went away): free its blocks.
            std::lock_guard<std::mutex> lock(pending->mu);
            if (pending->finish == serve::Finish::None || !pending->fresh.empty())
              engine.cancel(id);
          }
          std::lock_guard<std::mutex> lock(streamsMu);
          --openStreams;
          streamsDone.notify_all();
        });
  }

  /// Writes the tokens produced since the last call as events; false (which
  /// ends the response) when the client is gone. While there is nothing to
  /// send it writes an SSE comment now and then: a closed connection is only
  /// seen by writing to it.
  bool streamSome(Pending &p, uint64_t id, const std::string &name, size_t promptTokens, httplib::DataSink &sink) {
    std::vector<int32_t> batch;
    serve::Finish finish;
    {
      std::unique_lock<std::mutex> lock(p.mu);
      p.ready.wait_for(lock, std::chrono::milliseconds(100),
                       [&] { return !p.fresh.empty() || p.finish != serve::Finish::None; });
      batch.assign(p.fresh.begin(), p.fresh.end());
      p.fresh.clear();
      finish = p.finish;
    }
    auto send = [&](const std::string &text) {
      if (sink.write(text.data(), text.size()))
        return true;
      engine.cancel(id);
      return false;
    };
    if (batch.empty() && finish == serve::Finish::None)
      return send(": waiting\n\n");
    for (int32_t t : batch) {
      json choice = {{"index", 0}, {"tokens", json::array({t})}, {"finish_reason", nullptr}};
      if (p.text)
        choice["text"] = p.text->push(t); // "" while a character waits for its last byte
      json chunk = {{"id", name}, {"object", "text_completion"}, {"model", model}, {"choices", json::array({choice})}};
      if (!send("data: " + dumpJson(chunk) + "\n\n"))
        return false;
    }
    if (finish == serve::Finish::None)
      return true;
    size_t completion = 0;
    {
      std::lock_guard<std::mutex> lock(p.mu);
      completion = p.tokens.size();
    }
    json lastChoice = {{"index", 0}, {"tokens", json::array()}, {"finish_reason", serve::finishName(finish)}};
    if (p.text)
      lastChoice["text"] = p.text->finish();
    json last = {{"id", name},
                 {"object", "text_completion"},
                 {"model", model},
                 {"choices", json::array({lastChoice})},
                 {"usage",
                  {{"prompt_tokens", promptTokens},
                   {"completion_tokens", completion},
                   {"total_tokens", promptTokens + completion}}}};
    if (finish == serve::Finish::Error)
      last["error"] = {{"message", p.error}};
    if (!send("data: " + dumpJson(last) + "\n\ndata: [DONE]\n\n"))
      return false;
    sink.done();
    return true;
  }

  /// The engine's callback (on its thread): record, queue, wake the handler.
  void deliver(Pending &p, const serve::TokenEvent &e) {
    Clock::time_point now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(p.mu);
      if (e.token >= 0) {
        double since = std::chrono::duration<double>(now - (p.tokens.empty() ? p.submitted : p.last)).count();
        if (p.tokens.empty())
          metrics.timeToFirstToken(since);
        else
          metrics.interTokenLatency(since);
        p.tokens.push_back(e.token);
        p.fresh.push_back(e.token);
        p.last = now;
      }
      if (e.finish != serve::Finish::None) {
        p.finish = e.finish;
        p.error = e.error;
      }
    }
    p.ready.notify_all();
  }

  serve::Engine &engine;
  std::string model;
  std::unique_ptr<Tokenizer> tokenizer; // the bundle's, or null
  ServeMetrics metrics;
  std::atomic<bool> draining{false};
  std::mutex streamsMu;
  std::condition_variable streamsDone;
  int openStreams = 0; // guarded by streamsMu
};

int stopPipe[2] = {-1, -1};

void writeStopSignal(int signal) {
  unsigned char c = static_cast<unsigned char>(signal);
  (void)!write(stopPipe[1], &c, 1);
}

const char *usage() {
  return "usage: loom-serve BUNDLE --port P [--host 127.0.0.1] [--backend cpu|cuda] [--threads T]\n"
         "                  [--max-queue N]\n"
         "Serves a serving bundle (loomc compile --serve) over HTTP:\n"
         "  POST /v1/completions  {\"prompt\": [token ids] or text, \"max_tokens\": N, \"temperature\",\n"
         "                        \"top_p\", \"top_k\", \"repetition_penalty\", \"seed\", \"stop\": [ids],\n"
         "                        \"stream\", \"ignore_eos\"}\n"
         "                        text prompts and answers (\"text\") need a bundle with a tokenizer\n"
         "                        (loomc import); such bundles stop at its end of sequence\n"
         "  GET  /health          200, or 503 while draining after SIGTERM\n"
         "  GET  /metrics         Prometheus text format\n"
         "--port 0 picks a free port; the chosen one is printed (listening on HOST:PORT).\n";
}

int run(int argc, char **argv) {
  std::string bundle, host = "127.0.0.1";
  int port = -1;
  SessionOptions options;
  serve::EngineOptions engineOptions;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc)
        fail(LOOM_INVALID_ARGUMENT, a, " needs a value");
      return argv[++i];
    };
    auto whole = [&](long lo, long hi) {
      std::string v = value();
      char *end = nullptr;
      errno = 0;
      long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end || errno || n < lo || n > hi)
        fail(LOOM_INVALID_ARGUMENT, a, " must be a whole number in [", lo, ", ", hi, "], got '", v, "'");
      return n;
    };
    if (a == "--help" || a == "-h") {
      std::fputs(usage(), stdout);
      return 0;
    } else if (a == "--port")
      port = int(whole(0, 65535));
    else if (a == "--host")
      host = value();
    else if (a == "--backend")
      options.backend = value();
    else if (a == "--threads")
      options.threads = int(whole(1, 4096));
    else if (a == "--max-queue")
      engineOptions.maxQueue = size_t(whole(1, 1 << 30));
    else if (!a.empty() && a[0] == '-')
      fail(LOOM_INVALID_ARGUMENT, "unknown option '", a, "'\n", usage());
    else if (bundle.empty())
      bundle = a;
    else
      fail(LOOM_INVALID_ARGUMENT, "one bundle only, got '", bundle, "' and '", a, "'");
  }
  if (bundle.empty() || port < 0)
    fail(LOOM_INVALID_ARGUMENT, "a bundle and --port are required\n", usage());

  // A stop signal may land on any thread (libraries start some before
  // main): its handler only writes to a pipe that the main thread reads.
  if (pipe(stopPipe) != 0)
    fail(LOOM_INTERNAL, "pipe: ", std::strerror(errno));
  struct sigaction onStop = {};
  onStop.sa_handler = writeStopSignal;
  onStop.sa_flags = SA_RESTART;
  sigemptyset(&onStop.sa_mask);
  sigaction(SIGTERM, &onStop, nullptr);
  sigaction(SIGINT, &onStop, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  std::vector<std::unique_ptr<Session>> ranks = openLocalRanks(bundle, options);
  std::vector<Session *> sessions;
  for (auto &s : ranks)
    sessions.push_back(s.get());
  serve::Engine engine(sessions, engineOptions);
  const ServeConfig &cfg = engine.config();
  const Manifest &manifest = ranks.front()->manifest();
  std::unique_ptr<Tokenizer> tokenizer;
  if (!manifest.tokenizer.empty())
    tokenizer = Tokenizer::load(bundle + "/" + manifest.tokenizer);
  Server server(engine, manifest.model, std::move(tokenizer));

  httplib::Server http;
  // Handlers block while their request runs: enough threads for a full
  // queue beside the running batch, so that a burst is answered 429 by the
  // engine rather than left waiting for a thread.
  size_t threads = std::clamp<size_t>(engineOptions.maxQueue + size_t(cfg.maxBatch) + 16, 64, 256);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(kMaxBodyBytes);
  http.set_keep_alive_timeout(2);
  server.install(http);
  socket_t listening = INVALID_SOCKET;
  http.set_socket_options([&listening](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    listening = sock;
  });
  int bound = port == 0 ? http.bind_to_any_port(host) : (http.bind_to_port(host, port) ? port : -1);
  if (bound < 0)
    fail(LOOM_IO_ERROR, "cannot listen on ", host, ":", port);
  // Debian's httplib listens with a backlog of 5, too few for a burst of
  // clients: listening again on the socket raises it.
  ::listen(listening, SOMAXCONN);
  engine.start();
  std::thread listener([&] { http.listen_after_bind(); });
  std::printf("loom-serve: %s on the %s backend: max batch %lld, max sequence %lld, cache of %lld blocks, "
              "queue of %zu\n",
              bundle.c_str(), ranks.front()->backendName().c_str(), (long long)cfg.maxBatch, (long long)cfg.maxSeq,
              (long long)cfg.numBlocks, engineOptions.maxQueue);
  std::printf("listening on %s:%d\n", host.c_str(), bound);
  std::fflush(stdout);

  unsigned char signal = 0;
  while (read(stopPipe[0], &signal, 1) != 1) {
  }
  std::printf("loom-serve: %s: draining\n", signal == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stdout);
  server.beginDrain();
  engine.stop(/*drain=*/true);
  if (!server.waitForStreams(std::chrono::seconds(10)))
    std::fprintf(stderr, "loom-serve: streams still open 10 s after the drain; closing them\n");
  http.stop(); // waits for the handlers, which now have every token
  listener.join();
  serve::EngineStats s = engine.stats();
  std::printf("loom-serve: stopped after %llu requests (%llu finished, %llu cancelled, %llu refused)\n",
              (unsigned long long)s.submitted, (unsigned long long)s.finished, (unsigned long long)s.cancelled,
              (unsigned long long)s.refused);
  return 0;
}

} // namespace
} // namespace loom::rt

int main(int argc, char **argv) {
  try {
    return loom::rt::run(argc, argv);
  } catch (const std::bad_alloc &) {
    std::fprintf(stderr, "loom-serve: error: out of host memory\n");
  } catch (const std::exception &e) {
    std::fprintf(stderr, "loom-serve: error: %s\n", e.what());
  }
  return 1;
}
