//===- ServeMetrics.cpp - loom-serve's Prometheus metrics -----------------===//

#include "runtime/tools/ServeMetrics.h"

#include <algorithm>
#include <cstdio>

namespace loom::rt {

void LatencyWindow::add(double seconds) {
  sum += seconds;
  ++count;
  recent.push_back(seconds);
  if (recent.size() > capacity)
    recent.pop_front();
}

double LatencyWindow::quantile(double q) const {
  if (recent.empty())
    return 0;
  std::vector<double> v(recent.begin(), recent.end());
  size_t k = std::min(v.size() - 1, size_t(q * double(v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + long(k), v.end());
  return v[k];
}

void ServeMetrics::pruneTokens(Clock::time_point now) {
  while (!tokenTimes.empty() && std::chrono::duration<double>(now - tokenTimes.front()).count() > rateWindow)
    tokenTimes.pop_front();
}

void ServeMetrics::timeToFirstToken(double seconds) {
  std::lock_guard<std::mutex> lock(mu);
  firstToken.add(seconds);
  tokenTimes.push_back(Clock::now());
  pruneTokens(tokenTimes.back());
}

void ServeMetrics::interTokenLatency(double seconds) {
  std::lock_guard<std::mutex> lock(mu);
  perToken.add(seconds);
  tokenTimes.push_back(Clock::now());
  pruneTokens(tokenTimes.back());
}

void ServeMetrics::response(int status) {
  std::lock_guard<std::mutex> lock(mu);
  ++responses[status];
}

namespace {
void metric(std::string &out, const char *name, const char *type, const char *help) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}
void sample(std::string &out, const std::string &name, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, " %.9g\n", value);
  out += name + buf;
}
void summary(std::string &out, const char *name, const char *help, const LatencyWindow &w) {
  metric(out, name, "summary", help);
  sample(out, std::string(name) + "{quantile=\"0.5\"}", w.quantile(0.5));
  sample(out, std::string(name) + "{quantile=\"0.99\"}", w.quantile(0.99));
  sample(out, std::string(name) + "_sum", w.sum);
  sample(out, std::string(name) + "_count", double(w.count));
}
} // namespace

std::string ServeMetrics::render(const serve::EngineStats &s, bool draining) {
  std::lock_guard<std::mutex> lock(mu);
  Clock::time_point now = Clock::now();
  pruneTokens(now);
  double span = std::min(rateWindow, std::chrono::duration<double>(now - started).count());
  std::string out;
  auto counter = [&](const char *name, const char *help, uint64_t v) {
    metric(out, name, "counter", help);
    sample(out, name, double(v));
  };
  auto gauge = [&](const char *name, const char *help, double v) {
    metric(out, name, "gauge", help);
    sample(out, name, v);
  };
  counter("loom_requests_submitted_total", "Requests the engine accepted.", s.submitted);
  counter("loom_requests_finished_total", "Requests that ended by length or a stop token.", s.finished);
  counter("loom_requests_refused_total", "Requests refused: invalid, or the queue was full.", s.refused);
  counter("loom_requests_cancelled_total", "Requests cancelled (client gone, or shutdown).", s.cancelled);
  counter("loom_prompt_tokens_total", "Prompt tokens of accepted requests.", s.promptTokens);
  counter("loom_generated_tokens_total", "Tokens generated.", s.generatedTokens);
  counter("loom_engine_steps_total", "Step programs run.", s.steps);
  gauge("loom_queue_length", "Requests waiting for a slot.", double(s.waiting));
  gauge("loom_running_requests", "Requests in the running batch.", double(s.running));
  gauge("loom_cache_blocks_free", "Free key/value cache blocks.", double(s.freeBlocks));
  gauge("loom_cache_blocks_total", "Key/value cache blocks.", double(s.totalBlocks));
  gauge("loom_tokens_per_second", "Tokens generated per second over the last 10 seconds.",
        span > 0 ? double(tokenTimes.size()) / span : 0.0);
  gauge("loom_draining", "1 while the server drains before exiting.", draining ? 1 : 0);
  summary(out, "loom_time_to_first_token_seconds", "From submission to the first token (recent window).",
          firstToken);
  summary(out, "loom_inter_token_latency_seconds", "Between two tokens of a request (recent window).", perToken);
  metric(out, "loom_http_responses_total", "counter", "HTTP answers by status code.");
  for (auto &[code, n] : responses)
    sample(out, "loom_http_responses_total{code=\"" + std::to_string(code) + "\"}", double(n));
  return out;
}

} // namespace loom::rt
