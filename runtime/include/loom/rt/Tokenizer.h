//===- Tokenizer.h - Text to token ids and back -----------------*- C++ -*-===//
//
// The tokenizers Hugging Face checkpoints carry: GPT-2's byte-level BPE
// (tokenizer.json, read here) and SentencePiece models (tokenizer.model,
// through libsentencepiece where the runtime was built with it). A bundle
// names its tokenizer in the manifest's "tokenizer" field.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_TOKENIZER_H
#define LOOM_RUNTIME_TOKENIZER_H

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::rt {

class Tokenizer {
public:
  virtual ~Tokenizer() = default;

  /// A tokenizer.json (byte-level BPE) or a SentencePiece .model file.
  /// Throws Error naming the file and the field at fault.
  static std::unique_ptr<Tokenizer> load(const std::string &path);
  /// Whether this runtime was built with SentencePiece.
  static bool sentencePieceAvailable();

  /// Token ids of `text`, without special tokens such as BOS added.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  /// The text of `ids`; ids outside the vocabulary decode to nothing.
  virtual std::string decode(const std::vector<int32_t> &ids) const = 0;
  /// One more than the largest id.
  virtual int32_t vocabSize() const = 0;
  /// The id of a token written as text ("<|endoftext|>", "</s>").
  virtual std::optional<int32_t> tokenId(std::string_view token) const = 0;
  /// Begin and end of sequence: SentencePiece's own ids; for BPE the added
  /// token "<|endoftext|>" (GPT-2's both), else "<s>" / "</s>".
  virtual std::optional<int32_t> bosId() const = 0;
  virtual std::optional<int32_t> eosId() const = 0;
  /// Whether a prompt starts with BOS, as the checkpoint's own tokenizer
  /// does by default (SentencePiece models: Llama's add_bos_token; not
  /// GPT-2's BPE). promptIds applies it.
  virtual bool prependsBos() const { return false; }
  /// The ids of a prompt: encode(text), after BOS where prependsBos().
  std::vector<int32_t> promptIds(std::string_view text) const;

  /// Decodes a generation one token at a time. push returns the text that is
  /// complete so far: bytes of a UTF-8 character split over tokens wait for
  /// the token that finishes it. The concatenation of every push and finish
  /// equals decode of all the ids.
  class StreamDecoder {
  public:
    explicit StreamDecoder(const Tokenizer &tokenizer) : tokenizer(tokenizer) {}
    std::string push(int32_t id);
    /// What is still held back (an unfinished character), as it is.
    std::string finish();

  private:
    const Tokenizer &tokenizer;
    std::string pending;
    bool first = true;
  };

protected:
  /// The bytes `id` contributes to a decoded text; `first` for the
  /// sequence's first token (SentencePiece drops its leading space).
  virtual std::string tokenBytes(int32_t id, bool first) const = 0;
};

} // namespace loom::rt

#endif
