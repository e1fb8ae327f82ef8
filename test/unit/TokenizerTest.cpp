//===- TokenizerTest.cpp - Tokenizers against the reference libraries' ids ===//
//
// test/tokenizer/cases.json holds, for every case, the ids and decoded text
// of the tokenizers library (byte-level BPE) and of SentencePiece on the
// fixtures beside it (make_fixtures.py wrote all three).
//
//===----------------------------------------------------------------------===//

#include "loom/runtime.h"
#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"
#include "loom/rt/Tokenizer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <functional>
#include <unistd.h>
#include <fstream>

using loom::rt::Tokenizer;
using json = nlohmann::json;

namespace {

const std::string kDir = LOOM_TOKENIZER_FIXTURES;

json cases() {
  std::ifstream in(kDir + "/cases.json");
  return json::parse(in);
}

/// Whether `s` is whole UTF-8 characters (no character cut at either end).
bool wholeUtf8(const std::string &s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || i + len > s.size())
      return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80)
        return false;
    i += len;
  }
  return true;
}

void checkAgainstReference(const Tokenizer &tok, const std::string &kind) {
  json doc = cases();
  ASSERT_EQ(doc["texts"].size(), doc[kind].size());
  for (size_t i = 0; i < doc["texts"].size(); ++i) {
    std::string text = doc["texts"][i];
    std::vector<int32_t> expected = doc[kind][i]["ids"].get<std::vector<int32_t>>();
    std::string decoded = doc[kind][i]["decoded"];
    std::vector<int32_t> ids = tok.encode(text);
    EXPECT_EQ(ids, expected) << kind << " case " << i << ": '" << text << "'";
    EXPECT_EQ(tok.decode(expected), decoded) << kind << " case " << i;
    // One token at a time: only whole characters come out, and all of it.
    Tokenizer::StreamDecoder stream(tok);
    std::string streamed;
    for (int32_t id : expected) {
      std::string piece = stream.push(id);
      EXPECT_TRUE(wholeUtf8(piece)) << kind << " case " << i << " split a character";
      streamed += piece;
    }
    streamed += stream.finish();
    EXPECT_EQ(streamed, decoded) << kind << " case " << i;
  }
}

TEST(Tokenizer, BpeMatchesTheTokenizersLibrary) {
  auto tok = Tokenizer::load(kDir + "/bpe.tokenizer.json");
  EXPECT_EQ(tok->vocabSize(), 571); // as the tokenizers library counts it
  EXPECT_EQ(tok->eosId(), std::optional<int32_t>(0));
  EXPECT_EQ(tok->tokenId("<|endoftext|>"), std::optional<int32_t>(0));
  EXPECT_EQ(tok->tokenId("no such token"), std::nullopt);
  checkAgainstReference(*tok, "bpe");
}

TEST(Tokenizer, SentencePieceMatchesTheLibrary) {
  if (!Tokenizer::sentencePieceAvailable())
    GTEST_SKIP() << "built without SentencePiece";
  auto tok = Tokenizer::load(kDir + "/spm.model");
  EXPECT_EQ(tok->vocabSize(), 500);
  EXPECT_EQ(tok->bosId(), std::optional<int32_t>(1));
  EXPECT_EQ(tok->eosId(), std::optional<int32_t>(2));
  checkAgainstReference(*tok, "spm");
}

TEST(Tokenizer, StreamHoldsBackASplitCharacter) {
  auto tok = Tokenizer::load(kDir + "/bpe.tokenizer.json");
  // "🎉" is four bytes; byte-level BPE may give it several tokens.
  std::vector<int32_t> ids = tok->encode("🎉");
  ASSERT_GT(ids.size(), 1u);
  Tokenizer::StreamDecoder stream(*tok);
  EXPECT_EQ(stream.push(ids[0]), "");
  std::string rest;
  for (size_t i = 1; i < ids.size(); ++i)
    rest += stream.push(ids[i]);
  EXPECT_EQ(rest, "🎉");
  EXPECT_EQ(stream.finish(), "");
}

/// A copy of the BPE fixture with `edit` applied, written to a temporary file.
std::string editedBpe(const std::function<void(json &)> &edit, const std::string &name) {
  std::ifstream in(kDir + "/bpe.tokenizer.json");
  json doc = json::parse(in);
  edit(doc);
  std::string path = (std::filesystem::temp_directory_path() / name).string();
  std::ofstream(path) << doc.dump();
  return path;
}

void expectError(const std::string &path, const std::string &needle) {
  try {
    Tokenizer::load(path);
    ADD_FAILURE() << path << " loaded; expected an error with '" << needle << "'";
  } catch (const loom::rt::Error &e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, BadFilesAreRefusedNamingTheField) {
  std::string pid = std::to_string(::getpid());
  expectError(editedBpe([](json &d) { d["model"]["type"] = "WordPiece"; }, "wp-" + pid + ".json"),
              "'model.type' is 'WordPiece'");
  expectError(editedBpe([](json &d) { d["model"].erase("merges"); }, "nm-" + pid + ".json"),
              "'model.merges' is missing");
  expectError(editedBpe([](json &d) { d["model"]["merges"][3] = 7; }, "bm-" + pid + ".json"),
              "'model.merges[3]'");
  expectError(editedBpe([](json &d) { d["model"]["vocab"]["a"] = -4; }, "bv-" + pid + ".json"),
              "'model.vocab.a'");
  expectError(editedBpe([](json &d) { d["pre_tokenizer"] = {{"type", "Metaspace"}}; },
                        "ms-" + pid + ".json"),
              "'pre_tokenizer.type' is 'Metaspace'");
  expectError(editedBpe([](json &d) { d["added_tokens"][0].erase("content"); }, "at-" + pid + ".json"),
              "'added_tokens[0].content' is missing");
  std::string truncated = (std::filesystem::temp_directory_path() / ("tr-" + pid + ".json")).string();
  std::ofstream(truncated) << "{\"model\": {\"vocab\": {";
  expectError(truncated, "not a JSON object");
  std::string unknown = (std::filesystem::temp_directory_path() / ("tok-" + pid + ".txt")).string();
  std::ofstream(unknown) << "x";
  expectError(unknown, "unknown tokenizer kind");
  if (Tokenizer::sentencePieceAvailable()) {
    std::string garbage = (std::filesystem::temp_directory_path() / ("g-" + pid + ".model")).string();
    std::ofstream(garbage) << "this is no protobuf";
    expectError(garbage, "not a SentencePiece model");
  }
  for (const char *name : {"wp-", "nm-", "bm-", "bv-", "ms-", "at-", "tr-"})
    std::filesystem::remove(std::filesystem::temp_directory_path() / (name + pid + ".json"));
  std::filesystem::remove(unknown);
  std::filesystem::remove(std::filesystem::temp_directory_path() / ("g-" + pid + ".model"));
  EXPECT_THROW(Tokenizer::load(kDir + "/no-such-file.json"), loom::rt::Error);
}

/// The C API's tokenizer: sizes reported for a second call, the stream's
/// held-back character, and statuses rather than exceptions.
TEST(Tokenizer, CApiEncodesDecodesAndStreams) {
  loom_tokenizer_t *tok = nullptr;
  ASSERT_EQ(loom_tokenizer_create((kDir + "/bpe.tokenizer.json").c_str(), &tok), nullptr);
  EXPECT_EQ(loom_tokenizer_vocab_size(tok), 571);
  EXPECT_EQ(loom_tokenizer_eos_id(tok), 0);
  const std::string text = "hello 🎉 world";
  size_t n = 0;
  ASSERT_EQ(loom_tokenizer_encode(tok, text.data(), text.size(), nullptr, 0, &n), nullptr);
  std::vector<int32_t> ids(n);
  size_t again = 0;
  ASSERT_EQ(loom_tokenizer_encode(tok, text.data(), text.size(), ids.data(), ids.size(), &again), nullptr);
  EXPECT_EQ(again, n);
  auto reference = Tokenizer::load(kDir + "/bpe.tokenizer.json");
  EXPECT_EQ(ids, reference->encode(text));

  char small[4];
  size_t bytes = 0;
  ASSERT_EQ(loom_tokenizer_decode(tok, ids.data(), ids.size(), small, sizeof small, &bytes), nullptr);
  EXPECT_EQ(bytes, text.size());
  EXPECT_EQ(std::string(small, sizeof small), text.substr(0, 4));

  loom_token_decoder_t *decoder = nullptr;
  ASSERT_EQ(loom_token_decoder_create(tok, &decoder), nullptr);
  std::string streamed;
  for (int32_t id : ids) {
    const char *piece = nullptr;
    size_t length = 0;
    ASSERT_EQ(loom_token_decoder_push(decoder, id, &piece, &length), nullptr);
    EXPECT_EQ(std::strlen(piece), length);
    EXPECT_TRUE(wholeUtf8(piece));
    streamed += piece;
  }
  const char *rest = nullptr;
  ASSERT_EQ(loom_token_decoder_finish(decoder, &rest, nullptr), nullptr);
  EXPECT_EQ(streamed + rest, text);
  loom_token_decoder_destroy(decoder);
  loom_tokenizer_destroy(tok);

  loom_status_t *status = loom_tokenizer_create((kDir + "/no-such-file.json").c_str(), &tok);
  ASSERT_NE(status, nullptr);
  EXPECT_EQ(loom_status_code(status), LOOM_IO_ERROR);
  EXPECT_EQ(tok, nullptr);
  loom_status_free(status);
  status = loom_tokenizer_encode(nullptr, "x", 1, nullptr, 0, &n);
  ASSERT_NE(status, nullptr);
  EXPECT_STREQ(loom_status_message(status), "tokenizer must not be NULL");
  loom_status_free(status);
}

} // namespace
