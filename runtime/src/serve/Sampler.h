//===- Sampler.h - The next token from a row of logits ----------*- C++ -*-===//
//
// Greedy decoding, or sampling with temperature, top-k, top-p and a
// repetition penalty, from one request's own random stream (its seed), so
// that a request's tokens do not depend on what else is batched with it.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_SERVE_SAMPLER_H
#define LOOM_RUNTIME_SERVE_SAMPLER_H

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace loom::rt::serve {

struct SamplingParams {
  float temperature = 0;         // 0: greedy (the first largest logit)
  int32_t topK = 0;              // 0: every token
  float topP = 1;                // 1: every token
  float repetitionPenalty = 1;   // 1: none; >1 discourages tokens already in the sequence
  uint64_t seed = 0;
  int32_t maxNewTokens = 16;
  std::vector<int32_t> stopTokens; // generation ends after producing one of these
};

/// Why `params` cannot be used, or "" when they can.
std::string checkSamplingParams(const SamplingParams &params);

class Sampler {
public:
  explicit Sampler(const SamplingParams &params) : params(params), rng(params.seed) {}
  /// The next token from `logits` (vocab entries), given the tokens the
  /// sequence holds so far (for the repetition penalty).
  int32_t next(const float *logits, int64_t vocab, const std::vector<int32_t> &history);

private:
  SamplingParams params;
  std::mt19937_64 rng;
  std::vector<int32_t> order; // scratch
  std::vector<float> penalised;
};

} // namespace loom::rt::serve

#endif
