//===- Generate.cpp - loom-run --generate ---------------------------------===//
//
// Runs a serving bundle on a file of prompts through the serving engine (the
// continuous-batching scheduler the C API and loom-serve use), and reports
// what a user of a server sees: the tokens, the time to each request's first
// token and the time between tokens. --reference re-runs the full forward
// pass of an ordinary bundle of the same model at every step and checks that
// greedy decoding with the cache produced exactly its tokens.
//
//===----------------------------------------------------------------------===//

#include "runtime/tools/Generate.h"

#include "loom/rt/Error.h"
#include "loom/rt/Tokenizer.h"
#include "runtime/src/serve/Engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace loom::rt {

namespace {

using Clock = std::chrono::steady_clock;

/// The lines of a prompt file.
std::vector<std::string> readLines(const std::string &path) {
  std::ifstream in(path);
  if (!in)
    fail(LOOM_IO_ERROR, "cannot open prompt file '", path, "': ", std::strerror(errno));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  return lines;
}

std::vector<std::vector<int32_t>> readPrompts(const std::string &path) {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> lines = readLines(path);
  for (int lineNo = 1; lineNo <= int(lines.size()); ++lineNo) {
    std::string &line = lines[size_t(lineNo - 1)];
    for (char &c : line)
      if (c == ',' || c == '[' || c == ']')
        c = ' ';
    std::istringstream words(line);
    std::vector<int32_t> ids;
    for (std::string w; words >> w;) {
      char *end = nullptr;
      errno = 0;
      long long v = std::strtoll(w.c_str(), &end, 10);
      if (*end || errno || v < INT32_MIN || v > INT32_MAX)
        fail(LOOM_INVALID_ARGUMENT, path, ":", lineNo, ": '", w, "' is not a token id (prompts are token ids, ",
             "one prompt per line)");
      ids.push_back(static_cast<int32_t>(v));
    }
    if (!ids.empty())
      prompts.push_back(std::move(ids));
  }
  if (prompts.empty())
    fail(LOOM_INVALID_ARGUMENT, path, ": no prompt (write token ids, one prompt per line)");
  return prompts;
}

std::vector<std::string> readTextPrompts(const std::string &path) {
  std::vector<std::string> texts;
  for (std::string &line : readLines(path))
    if (!line.empty())
      texts.push_back(std::move(line));
  if (texts.empty())
    fail(LOOM_INVALID_ARGUMENT, path, ": no prompt (one prompt per line)");
  return texts;
}

struct Result {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits; // kept for --reference
  std::vector<double> at;                 // ms since submission, per token
  serve::Finish finish = serve::Finish::None;
  std::string error;
};

double percentile(std::vector<double> v, double p) {
  if (v.empty())
    return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))];
}

/// Every prompt submitted at once; the engine steps on this thread.
std::vector<Result> runOnce(serve::Engine &engine, const std::vector<std::vector<int32_t>> &prompts,
                            const serve::SamplingParams &sampling, bool keepLogits, double &seconds) {
  std::vector<Result> results(prompts.size());
  Clock::time_point start = Clock::now();
  for (size_t i = 0; i < prompts.size(); ++i) {
    Result *res = &results[i];
    engine.submit(prompts[i], sampling, [res, start, keepLogits](const serve::TokenEvent &e) {
      if (e.token >= 0) {
        res->tokens.push_back(e.token);
        res->at.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
        if (keepLogits && e.logits)
          res->logits.emplace_back(e.logits, e.logits + e.vocab);
      }
      if (e.finish != serve::Finish::None)
        res->finish = e.finish, res->error = e.error;
    });
  }
  engine.runUntilIdle();
  seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (const Result &r : results)
    if (r.finish == serve::Finish::Error)
      fail(LOOM_INTERNAL, "generation failed: ", r.error);
  return results;
}

/// The bytes of weights a one-token step of `program` reads: every
/// parameter or prepared weight it reads and no instruction of it writes,
/// once (the embedding's table only for the rows it looks up, unless a
/// product reads the whole table too, as a tied head does).
double weightBytesPerStep(const RankProgram &r, const std::string &program) {
  auto it = r.programs.find(program);
  if (it == r.programs.end())
    return 0;
  std::set<int64_t> written;
  for (const Instruction &ins : it->second)
    for (int64_t id : ins.out)
      written.insert(storageOf(r, id));
  std::map<int64_t, double> bytes; // by storage: the most any instruction reads of it
  for (const Instruction &ins : it->second)
    for (size_t k = 0; k < ins.in.size(); ++k) {
      int64_t s = storageOf(r, ins.in[k]);
      const Buffer &b = r.buffers[size_t(s)];
      if ((b.role != BufferRole::Param && b.role != BufferRole::Cache) || written.count(s))
        continue;
      double read = double(b.bytes);
      if (ins.op == "embedding" && k == 0 && b.shape.size() == 2 && b.shape[0] > 0 && ins.in.size() > 1)
        read = double(b.bytes) / double(b.shape[0]) * double(numElements(r.buffers[size_t(ins.in[1])].shape).value_or(0));
      bytes[s] = std::max(bytes[s], read);
    }
  double total = 0;
  for (auto &[_, b] : bytes)
    total += b;
  return total;
}

/// Greedy decoding by re-running the forward pass over the whole sequence
/// for every new token; returns the largest logit difference, fails on the
/// first token that differs.
double checkAgainstForward(Session &ref, const std::vector<std::vector<int32_t>> &prompts,
                           const std::vector<Result> &results, size_t &checked, size_t &ties) {
  const RankProgram &r = ref.rank();
  if (ref.manifest().mode != "infer" || r.inputs.size() != 1 || r.outputs.size() != 1)
    fail(LOOM_INVALID_ARGUMENT, "--reference needs a one-rank forward bundle of the same model "
         "(loomc compile MODEL --batch 1 with the same --seed or --weights)");
  const Buffer &in = r.buffers[r.inputs[0].buffer], &out = r.buffers[r.outputs[0].buffer];
  if (in.shape.size() != 2 || in.shape[0] != 1 || in.dtype != LOOM_I32 || out.shape.size() != 3)
    fail(LOOM_INVALID_ARGUMENT, "--reference needs token ids [1, seq] in and logits [1, seq, vocab] out");
  int64_t S = in.shape[1], V = out.shape[2];
  double worst = 0;
  for (size_t q = 0; q < prompts.size(); ++q) {
    std::vector<int32_t> seq = prompts[q];
    const Result &res = results[q];
    for (size_t j = 0; j < res.tokens.size(); ++j) {
      if (int64_t(seq.size()) > S)
        fail(LOOM_INVALID_ARGUMENT, "--reference: request ", q, " reaches ", seq.size(),
             " tokens, longer than the reference bundle's sequence of ", S);
      std::vector<int32_t> padded(size_t(S), 0);
      std::copy(seq.begin(), seq.end(), padded.begin());
      ref.bindInput(r.inputs[0].name, padded.data(), padded.size() * sizeof(int32_t));
      ref.runForward();
      std::vector<char> raw = ref.read(out);
      std::vector<float> row(static_cast<size_t>(V));
      for (int64_t v = 0; v < V; ++v)
        row[v] = float(loadAsDouble(out.dtype, raw.data(), (int64_t(seq.size()) - 1) * V + v));
      int32_t want = int32_t(std::max_element(row.begin(), row.end()) - row.begin());
      if (res.tokens[j] != want) {
        // Two logits within a few roundings of each other are a tie that
        // summation order decides; the check goes on along the cache's
        // sequence. bf16 (8 bits of mantissa): 1/32 relative, four to eight
        // units in the last place. The decoding kernels and the forward pass's
        // products round in different places (a norm folded into the
        // products is not rounded to bf16 between, and which of cuBLASLt and
        // our kernel runs a product is timed when a program is prepared):
        // on TinyLlama's 22 random-weight layers their bf16 logits differ
        // by up to 0.12, and a 2-unit gap between the best two (3.516
        // against 3.484) was seen to flip from one run to the next.
        float got = row[size_t(res.tokens[j])], best = row[size_t(want)];
        double tolerance = out.dtype == LOOM_BF16 ? 1.0 / 32 : 1e-5;
        if (best - got > tolerance * std::max(1.0f, std::fabs(best)))
          fail(LOOM_INTERNAL, "request ", q, " new token ", j, ": the cache gave ", res.tokens[j],
               " but re-running the forward pass gives ", want, " (logits ", got, " vs ", best, ")");
        ++ties;
      }
      if (j < res.logits.size())
        for (int64_t v = 0; v < V; ++v)
          worst = std::max(worst, double(std::fabs(row[v] - res.logits[j][size_t(v)])));
      seq.push_back(res.tokens[j]);
      ++checked;
    }
  }
  return worst;
}

} // namespace

const char *generateUsage() {
  return "Serving bundles (loomc compile --serve): generate with the KV cache\n"
         "  --generate              (implied by a serving bundle)\n"
         "  --prompt F              token ids, one prompt per line; all are submitted at\n"
         "                          once and batched continuously\n"
         "  --text                  the --prompt file's lines are text, encoded with the\n"
         "                          bundle's tokenizer (loomc import; the answers are\n"
         "                          decoded too)\n"
         "  --prompt-text S         one prompt as text (repeatable; implies a tokenizer)\n"
         "  --ignore-eos            text prompts stop at the tokenizer's end of sequence\n"
         "                          unless this is given\n"
         "  --max-new N             new tokens per prompt at most (default 16)\n"
         "  --temperature T         0 (default): greedy; above 0: sampling\n"
         "  --top-k K, --top-p P    sampling: the K likeliest, the smallest set of mass P\n"
         "  --repetition-penalty R  divide the logits of tokens already seen by R\n"
         "  --sample-seed S         seed of each request's sampling (default 0)\n"
         "  --stop ID[,ID...]       end a request when it produces one of these tokens\n"
         "  --repeat N              time N runs of the set after one warm-up (default 1)\n"
         "  --reference F.loom      check every token against re-running the full forward\n"
         "                          pass of this ordinary bundle of the same model (greedy)\n";
}

bool parseGenerateOption(int argc, char **argv, int &i, GenerateOptions &o) {
  std::string a = argv[i];
  auto value = [&]() -> std::string {
    if (i + 1 >= argc)
      fail(LOOM_INVALID_ARGUMENT, a, " needs a value");
    return argv[++i];
  };
  auto number = [&](double lo, double hi) {
    std::string v = value();
    char *end = nullptr;
    errno = 0;
    double d = std::strtod(v.c_str(), &end);
    if (v.empty() || *end || errno || !(d >= lo && d <= hi))
      fail(LOOM_INVALID_ARGUMENT, a, " must be a number in [", lo, ", ", hi, "], got '", v, "'");
    return d;
  };
  auto whole = [&](double lo, double hi) {
    double d = number(lo, hi);
    if (d != std::floor(d))
      fail(LOOM_INVALID_ARGUMENT, a, " must be a whole number, got ", d);
    return static_cast<int64_t>(d);
  };
  serve::SamplingParams &s = o.sampling;
  if (a == "--generate")
    return true;
  if (a == "--prompt")
    o.promptFile = value();
  else if (a == "--prompt-text")
    o.promptTexts.push_back(value());
  else if (a == "--text")
    o.text = true;
  else if (a == "--ignore-eos")
    o.ignoreEos = true;
  else if (a == "--reference")
    o.reference = value();
  else if (a == "--max-new")
    s.maxNewTokens = int32_t(whole(1, 1e9));
  else if (a == "--temperature")
    s.temperature = float(number(0, 1e6));
  else if (a == "--top-k")
    s.topK = int32_t(whole(0, 1e9));
  else if (a == "--top-p")
    s.topP = float(number(1e-9, 1));
  else if (a == "--repetition-penalty")
    s.repetitionPenalty = float(number(1e-6, 1e6));
  else if (a == "--sample-seed")
    s.seed = uint64_t(whole(0, 9e15));
  else if (a == "--repeat")
    o.repeat = int(whole(1, 1e6));
  else if (a == "--stop") {
    std::string list = value();
    std::stringstream parts(list);
    for (std::string t; std::getline(parts, t, ',');) {
      char *end = nullptr;
      long long v = std::strtoll(t.c_str(), &end, 10);
      if (t.empty() || *end || v < 0 || v > INT32_MAX)
        fail(LOOM_INVALID_ARGUMENT, "--stop takes token ids separated by commas, got '", list, "'");
      s.stopTokens.push_back(int32_t(v));
    }
  } else
    return false;
  return true;
}

int generate(std::vector<std::unique_ptr<Session>> &ranks, const GenerateOptions &o,
             const SessionOptions &sessionOptions) {
  if (o.promptFile.empty() && o.promptTexts.empty())
    fail(LOOM_INVALID_ARGUMENT, "--generate needs --prompt F (token ids, one prompt per line; text with --text) "
         "or --prompt-text S");
  if (o.text && o.promptFile.empty())
    fail(LOOM_INVALID_ARGUMENT, "--text reads the --prompt file's lines as text: give --prompt F");
  if (!o.reference.empty() && o.sampling.temperature != 0)
    fail(LOOM_INVALID_ARGUMENT, "--reference checks greedy decoding: leave --temperature at 0");
  // The bundle's tokenizer, if it has one: text prompts in, text out.
  std::unique_ptr<Tokenizer> tokenizer;
  const Manifest &manifest = ranks.front()->manifest();
  bool textIn = o.text || !o.promptTexts.empty();
  if (!manifest.tokenizer.empty())
    tokenizer = Tokenizer::load(o.bundle + "/" + manifest.tokenizer);
  else if (textIn)
    fail(LOOM_INVALID_ARGUMENT, o.bundle, " carries no tokenizer, so its prompts are token ids: leave out --text and "
         "--prompt-text, or compile a model imported with its tokenizer (loomc import) or with --tokenizer F");
  std::vector<std::vector<int32_t>> prompts;
  if (!o.promptFile.empty() && !o.text)
    prompts = readPrompts(o.promptFile);
  std::vector<std::string> texts = o.text ? readTextPrompts(o.promptFile) : std::vector<std::string>{};
  texts.insert(texts.end(), o.promptTexts.begin(), o.promptTexts.end());
  for (const std::string &t : texts)
    prompts.push_back(tokenizer->promptIds(t));
  serve::SamplingParams sampling = o.sampling;
  if (textIn && !o.ignoreEos && tokenizer->eosId())
    sampling.stopTokens.push_back(*tokenizer->eosId());
  std::vector<Session *> sessions;
  for (auto &s : ranks)
    sessions.push_back(s.get());
  serve::EngineOptions engineOptions;
  engineOptions.eventLogits = !o.reference.empty(); // the reference compares logits too
  serve::Engine engine(sessions, engineOptions);
  const ServeConfig &cfg = engine.config();
  std::printf("serving: %zu step programs (%lld to %lld tokens), cache of %lld blocks of %lld tokens, "
              "max batch %lld, max sequence %lld\n",
              cfg.programs.size(), (long long)cfg.programs.front().tokens, (long long)cfg.programs.back().tokens,
              (long long)cfg.numBlocks, (long long)cfg.blockSize, (long long)cfg.maxBatch, (long long)cfg.maxSeq);
  bool keep = !o.reference.empty();
  double seconds = 0;
  std::vector<Result> results = runOnce(engine, prompts, sampling, keep, seconds); // warm-up
  const serve::EngineStats before = engine.stats();
  double total = 0;
  std::vector<double> firsts, gaps;
  size_t generated = 0;
  for (int rep = 0; rep < o.repeat; ++rep) {
    results = runOnce(engine, prompts, sampling, keep, seconds);
    total += seconds;
    for (const Result &r : results) {
      generated += r.tokens.size();
      if (!r.at.empty())
        firsts.push_back(r.at.front());
      for (size_t k = 1; k < r.at.size(); ++k)
        gaps.push_back(r.at[k] - r.at[k - 1]);
    }
  }
  for (size_t q = 0; q < results.size(); ++q) {
    std::printf("request %zu: %zu prompt + %zu new tokens (%s):", q, prompts[q].size(), results[q].tokens.size(),
                serve::finishName(results[q].finish));
    for (int32_t t : results[q].tokens)
      std::printf(" %d", t);
    std::printf("\n");
    if (tokenizer) // as a JSON string, so that any byte shows
      std::printf("request %zu text: %s\n", q,
                  nlohmann::json(tokenizer->decode(results[q].tokens))
                      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                      .c_str());
  }
  double mean = 0;
  for (double g : gaps)
    mean += g;
  mean = gaps.empty() ? 0 : mean / double(gaps.size());
  std::printf("time to first token: p50 %.3f ms, p99 %.3f ms\n", percentile(firsts, 0.5), percentile(firsts, 0.99));
  std::printf("per-token latency: mean %.3f ms, p50 %.3f ms, p99 %.3f ms\n", mean, percentile(gaps, 0.5),
              percentile(gaps, 0.99));
  // What a decoding step reads of the weights, against its time: the
  // fraction of the memory's bandwidth a batch-1 step reaches.
  double weights = 0;
  for (auto &s : ranks)
    weights = std::max(weights, weightBytesPerStep(s->rank(), cfg.programs.front().name));
  if (weights > 0 && mean > 0)
    std::printf("weights read a decoding step: %.1f MB a rank, %.2f TB/s at the mean per-token latency\n",
                weights / 1e6, weights / (mean * 1e-3) / 1e12);
  std::printf("throughput: %.1f tokens/s (%zu new tokens of %zu requests in %.3f s, %d timed run%s after 1 "
              "warm-up)\n",
              total > 0 ? double(generated) / total : 0.0, generated, prompts.size() * size_t(o.repeat), total,
              o.repeat, o.repeat == 1 ? "" : "s");
  const serve::EngineStats after = engine.stats();
  if (uint64_t steps = after.steps - before.steps) {
    auto ms = [&](double a, double b) { return (a - b) / double(steps) * 1e3; };
    std::printf("engine steps: %llu, mean %.3f ms: inputs %.3f, program %.3f, logits %.3f, sampling %.3f\n",
                (unsigned long long)steps,
                ms(after.inputSeconds + after.programSeconds + after.logitsSeconds + after.sampleSeconds,
                   before.inputSeconds + before.programSeconds + before.logitsSeconds + before.sampleSeconds),
                ms(after.inputSeconds, before.inputSeconds), ms(after.programSeconds, before.programSeconds),
                ms(after.logitsSeconds, before.logitsSeconds), ms(after.sampleSeconds, before.sampleSeconds));
  }
  if (!o.reference.empty()) {
    SessionOptions refOptions = sessionOptions;
    refOptions.rank = 0;
    refOptions.comm = nullptr;
    refOptions.nccl = nullptr;
    Session ref(o.reference, refOptions);
    size_t checked = 0, ties = 0;
    double worst = checkAgainstForward(ref, prompts, results, checked, ties);
    std::printf("reference: %zu tokens equal greedy decoding by re-running the forward pass of %s; "
                "largest logit difference %.3g\n",
                checked - ties, o.reference.c_str(), worst);
    if (ties)
      std::printf("reference: %zu more where the two best logits tie (within the tolerance of their rounding)\n",
                  ties);
  }
  return 0;
}

} // namespace loom::rt
