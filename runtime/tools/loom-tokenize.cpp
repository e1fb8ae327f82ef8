//===- loom-tokenize.cpp - Text to token ids and back with a bundle's tokenizer ===//
//
// loom-tokenize BUNDLE|TOKENIZER TEXT             prints the ids of TEXT
// loom-tokenize BUNDLE|TOKENIZER --decode ID...   prints the text of the ids,
//                                                 decoded one token at a time
//
//===----------------------------------------------------------------------===//

#include "loom/rt/Bundle.h"
#include "loom/rt/Error.h"
#include "loom/rt/Tokenizer.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

using namespace loom::rt;

namespace {
int run(int argc, char **argv) {
  if (argc < 3 || !std::strcmp(argv[1], "--help")) {
    std::fprintf(argc < 3 ? stderr : stdout,
                 "usage: loom-tokenize BUNDLE|TOKENIZER TEXT\n"
                 "       loom-tokenize BUNDLE|TOKENIZER --decode ID...\n\n"
                 "Encodes TEXT with a bundle's tokenizer (the manifest's \"tokenizer\") or a\n"
                 "tokenizer.json / SentencePiece .model file, or decodes ids one at a time as\n"
                 "a generation streams them.\n");
    return argc < 3 ? 1 : 0;
  }
  std::string source = argv[1], path = source;
  struct stat st;
  if (::stat(source.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    Manifest m = readManifest(source);
    if (m.tokenizer.empty())
      fail(LOOM_INVALID_ARGUMENT, source, ": the bundle carries no tokenizer (import a checkpoint "
           "that has one, or compile with --tokenizer F)");
    path = source + "/" + m.tokenizer;
  }
  auto tokenizer = Tokenizer::load(path);
  if (std::strcmp(argv[2], "--decode") != 0) {
    if (argc != 3)
      fail(LOOM_INVALID_ARGUMENT, "give the text as one argument");
    std::string sep;
    for (int32_t id : tokenizer->encode(argv[2])) {
      std::printf("%s%d", sep.c_str(), id);
      sep = " ";
    }
    std::printf("\n");
    return 0;
  }
  Tokenizer::StreamDecoder stream(*tokenizer);
  for (int i = 3; i < argc; ++i) {
    char *end = nullptr;
    long id = std::strtol(argv[i], &end, 10);
    if (!*argv[i] || *end || id < 0 || id >= tokenizer->vocabSize())
      fail(LOOM_INVALID_ARGUMENT, "'", argv[i], "' is no token id (0 to ",
           tokenizer->vocabSize() - 1, ")");
    std::fputs(stream.push(static_cast<int32_t>(id)).c_str(), stdout);
  }
  std::printf("%s\n", stream.finish().c_str());
  return 0;
}
} // namespace

int main(int argc, char **argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception &e) {
    std::fprintf(stderr, "loom-tokenize: error: %s\n", e.what());
    return 1;
  }
}
