//===- Sampler.cpp - The next token from a row of logits ------------------===//

#include "runtime/src/serve/Sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_set>

namespace loom::rt::serve {

std::string checkSamplingParams(const SamplingParams &p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    return "temperature must be a finite number >= 0";
  if (p.topK < 0)
    return "top_k must be >= 0 (0: off)";
  if (!(p.topP > 0 && p.topP <= 1))
    return "top_p must be in (0, 1]";
  if (!(p.repetitionPenalty > 0) || !std::isfinite(p.repetitionPenalty))
    return "repetition_penalty must be a finite number > 0";
  if (p.maxNewTokens < 1)
    return "max_tokens must be at least 1";
  return "";
}

int32_t Sampler::next(const float *logits, int64_t vocab, const std::vector<int32_t> &history) {
  if (params.repetitionPenalty != 1) {
    penalised.assign(logits, logits + vocab);
    // As in the CTRL paper and transformers: a seen token's positive logit
    // is divided by the penalty, a negative one multiplied by it.
    std::unordered_set<int32_t> seen(history.begin(), history.end());
    for (int32_t t : seen)
      if (t >= 0 && t < vocab)
        penalised[t] = penalised[t] > 0 ? penalised[t] / params.repetitionPenalty
                                        : penalised[t] * params.repetitionPenalty;
    logits = penalised.data();
  }
  if (params.temperature == 0)
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  // Candidates by logit, largest first (ties by id, for reproducibility).
  order.resize(size_t(vocab));
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = params.topK > 0 ? std::min<int64_t>(params.topK, vocab) : vocab;
  auto larger = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), larger);
  double top = logits[order[0]] / params.temperature;
  std::vector<double> probs(static_cast<size_t>(keep));
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i)
    sum += (probs[i] = std::exp(double(logits[order[i]]) / params.temperature - top));
  if (params.topP < 1) {
    // The smallest prefix whose probability reaches top_p.
    double mass = 0;
    int64_t n = 0;
    while (n < keep && mass < params.topP * sum)
      mass += probs[n++];
    keep = std::max<int64_t>(n, 1);
    sum = mass > 0 ? mass : probs[0];
  }
  double u = std::uniform_real_distribution<double>(0, sum)(rng), acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += probs[i];
    if (u < acc)
      return order[i];
  }
  return order[keep - 1];
}

} // namespace loom::rt::serve
