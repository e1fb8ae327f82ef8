//===- Tokenizer.cpp - Choosing a tokenizer, streaming decode, SentencePiece ===//

#include "loom/rt/Tokenizer.h"
#include "runtime/src/TokenizerImpl.h"
#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"

#include <cstring>
#include <sys/stat.h>

#ifdef LOOM_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

namespace loom::rt {

namespace {

bool endsWith(const std::string &s, const char *suffix) {
  size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

/// Length of the prefix of `s` made of whole UTF-8 characters: a lead byte
/// whose continuation bytes have not all arrived ends it. Invalid bytes
/// count as whole (they will never be completed).
size_t completeUtf8Prefix(const std::string &s) {
  size_t n = s.size();
  // A character is at most 4 bytes: look back at most 3 for its lead byte.
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80)
      continue; // a continuation byte: its lead is further back
    size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return need > back ? n - back : n;
  }
  return n;
}

#ifdef LOOM_HAVE_SENTENCEPIECE
class SentencePieceTokenizer final : public Tokenizer {
public:
  explicit SentencePieceTokenizer(const std::string &path) {
    auto status = processor.Load(path);
    if (!status.ok())
      fail(LOOM_INVALID_ARGUMENT, path, ": not a SentencePiece model: ", status.ToString());
  }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    auto status = processor.Encode(std::string(text), &ids);
    if (!status.ok())
      fail(LOOM_INVALID_ARGUMENT, "SentencePiece cannot encode the text: ", status.ToString());
    return {ids.begin(), ids.end()};
  }
  std::string decode(const std::vector<int32_t> &ids) const override {
    std::vector<int> valid;
    for (int32_t id : ids)
      if (id >= 0 && id < vocabSize())
        valid.push_back(id);
    std::string text;
    auto status = processor.Decode(valid, &text);
    if (!status.ok())
      fail(LOOM_INVALID_ARGUMENT, "SentencePiece cannot decode the ids: ", status.ToString());
    return text;
  }
  int32_t vocabSize() const override { return processor.GetPieceSize(); }
  std::optional<int32_t> tokenId(std::string_view token) const override {
    int id = processor.PieceToId(std::string(token));
    if (processor.IsUnknown(id) && processor.IdToPiece(id) != token)
      return std::nullopt;
    return id;
  }
  std::optional<int32_t> bosId() const override { return optionalId(processor.bos_id()); }
  std::optional<int32_t> eosId() const override { return optionalId(processor.eos_id()); }
  bool prependsBos() const override { return bosId().has_value(); }

protected:
  std::string tokenBytes(int32_t id, bool first) const override {
    if (id < 0 || id >= vocabSize() || processor.IsControl(id) || processor.IsUnused(id))
      return "";
    if (processor.IsUnknown(id))
      return " \xE2\x81\x87 "; // SentencePiece's unknown mark, U+2047
    std::string piece = processor.IdToPiece(id);
    if (processor.IsByte(id)) // "<0xAB>"
      return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
    std::string out;
    const std::string space = "\xE2\x96\x81"; // U+2581, SentencePiece's word boundary
    for (size_t i = 0; i < piece.size();) {
      if (piece.compare(i, space.size(), space) == 0) {
        out += ' ';
        i += space.size();
      } else {
        out += piece[i++];
      }
    }
    if (first && !out.empty() && out[0] == ' ')
      out.erase(0, 1);
    return out;
  }

private:
  static std::optional<int32_t> optionalId(int id) {
    return id >= 0 ? std::optional<int32_t>(id) : std::nullopt;
  }
  sentencepiece::SentencePieceProcessor processor;
};
#endif

} // namespace

bool Tokenizer::sentencePieceAvailable() {
#ifdef LOOM_HAVE_SENTENCEPIECE
  return true;
#else
  return false;
#endif
}

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string &path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    fail(LOOM_IO_ERROR, "cannot read tokenizer '", path, "': not a regular file");
  if (endsWith(path, ".json"))
    return parseBpeTokenizer(readWholeFile(path), path);
  if (endsWith(path, ".model")) {
#ifdef LOOM_HAVE_SENTENCEPIECE
    return std::make_unique<SentencePieceTokenizer>(path);
#else
    fail(LOOM_UNSUPPORTED, path, ": a SentencePiece tokenizer, but this runtime was built without "
         "SentencePiece (install libsentencepiece-dev and rebuild)");
#endif
  }
  fail(LOOM_INVALID_ARGUMENT, path, ": unknown tokenizer kind; expected tokenizer.json "
       "(byte-level BPE) or a SentencePiece .model");
}

std::vector<int32_t> Tokenizer::promptIds(std::string_view text) const {
  std::vector<int32_t> ids;
  if (prependsBos())
    ids.push_back(*bosId());
  std::vector<int32_t> body = encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

std::string Tokenizer::StreamDecoder::push(int32_t id) {
  pending += tokenizer.tokenBytes(id, first);
  first = false;
  size_t complete = completeUtf8Prefix(pending);
  std::string out = pending.substr(0, complete);
  pending.erase(0, complete);
  return out;
}

std::string Tokenizer::StreamDecoder::finish() {
  std::string out;
  out.swap(pending);
  return out;
}

} // namespace loom::rt
