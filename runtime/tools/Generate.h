//===- Generate.h - loom-run --generate ------------------------*- C++ -*-===//
#ifndef LOOM_RUNTIME_TOOLS_GENERATE_H
#define LOOM_RUNTIME_TOOLS_GENERATE_H

#include "runtime/src/Session.h"
#include "runtime/src/serve/Sampler.h"

#include <memory>
#include <string>
#include <vector>

namespace loom::rt {

struct GenerateOptions {
  std::string bundle;       // the serving bundle (its tokenizer, if it has one)
  std::string promptFile;   // token ids, one prompt per line (text with `text`)
  std::vector<std::string> promptTexts; // --prompt-text, one prompt each
  bool text = false;        // the prompt file's lines are text
  bool ignoreEos = false;   // text prompts stop at the tokenizer's EOS unless set
  std::string reference;    // a forward bundle to check every step against
  serve::SamplingParams sampling;
  int repeat = 1;           // timed runs of the whole set after one warm-up
};

/// Options of loom-run that belong to --generate: consumes argv[i] (and its
/// value) when it is one, and returns whether it was.
bool parseGenerateOption(int argc, char **argv, int &i, GenerateOptions &options);
/// The --generate part of loom-run's help.
const char *generateUsage();

/// Generates for every prompt at once through the serving engine (all ranks
/// of the bundle in this process), prints each request's tokens, time to
/// first token and per-token latency; with a reference bundle, checks that
/// every token equals greedy decoding by re-running the full forward pass.
/// Returns the exit code.
int generate(std::vector<std::unique_ptr<Session>> &ranks, const GenerateOptions &options,
             const SessionOptions &sessionOptions);

} // namespace loom::rt

#endif
