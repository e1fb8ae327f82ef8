//===- CApiTokenizer.cpp - The C API's tokenizers -------------------------===//
//
// loom_tokenizer_* and loom_token_decoder_* over loom::rt::Tokenizer: a
// bundle's tokenizer for text prompts and for streaming a generation's text.
//
//===----------------------------------------------------------------------===//

#include "loom/runtime.h"
#include "loom/rt/Bundle.h"
#include "loom/rt/Tokenizer.h"
#include "runtime/src/CApiStatus.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <memory>

using loom::rt::capi::guarded;
using loom::rt::capi::nullArgument;

struct loom_tokenizer_t {
  std::unique_ptr<loom::rt::Tokenizer> impl;
};

struct loom_token_decoder_t {
  loom::rt::Tokenizer::StreamDecoder stream;
  std::string piece; // what the last push or finish returned
};

extern "C" {

loom_status_t *loom_tokenizer_create(const char *path, loom_tokenizer_t **out_tokenizer) {
  if (!path)
    return nullArgument("path");
  if (!out_tokenizer)
    return nullArgument("out_tokenizer");
  *out_tokenizer = nullptr;
  return guarded([&] {
    std::string file = path;
    struct stat st;
    if (::stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
      loom::rt::Manifest m = loom::rt::readManifest(path);
      if (m.tokenizer.empty())
        loom::rt::fail(LOOM_INVALID_ARGUMENT, path, ": the bundle carries no tokenizer (import a checkpoint "
                       "that has one, or compile with --tokenizer F)");
      file = std::string(path) + "/" + m.tokenizer;
    }
    auto tokenizer = std::make_unique<loom_tokenizer_t>();
    tokenizer->impl = loom::rt::Tokenizer::load(file);
    *out_tokenizer = tokenizer.release();
  });
}

void loom_tokenizer_destroy(loom_tokenizer_t *tokenizer) { delete tokenizer; }

int32_t loom_tokenizer_vocab_size(const loom_tokenizer_t *tokenizer) {
  return tokenizer ? tokenizer->impl->vocabSize() : 0;
}

int32_t loom_tokenizer_bos_id(const loom_tokenizer_t *tokenizer) {
  return tokenizer ? tokenizer->impl->bosId().value_or(-1) : -1;
}

int32_t loom_tokenizer_eos_id(const loom_tokenizer_t *tokenizer) {
  return tokenizer ? tokenizer->impl->eosId().value_or(-1) : -1;
}

int loom_tokenizer_prepends_bos(const loom_tokenizer_t *tokenizer) {
  return tokenizer && tokenizer->impl->prependsBos() ? 1 : 0;
}

loom_status_t *loom_tokenizer_encode(const loom_tokenizer_t *tokenizer, const char *text, size_t text_bytes,
                                     int32_t *tokens, size_t capacity, size_t *out_num_tokens) {
  if (!tokenizer)
    return nullArgument("tokenizer");
  if (!text && text_bytes > 0)
    return nullArgument("text");
  if (!tokens && capacity > 0)
    return nullArgument("tokens");
  if (!out_num_tokens)
    return nullArgument("out_num_tokens");
  return guarded([&] {
    std::vector<int32_t> ids = tokenizer->impl->encode(std::string_view(text ? text : "", text_bytes));
    std::copy_n(ids.begin(), std::min(capacity, ids.size()), tokens);
    *out_num_tokens = ids.size();
  });
}

loom_status_t *loom_tokenizer_decode(const loom_tokenizer_t *tokenizer, const int32_t *tokens, size_t num_tokens,
                                     char *text, size_t capacity, size_t *out_bytes) {
  if (!tokenizer)
    return nullArgument("tokenizer");
  if (!tokens && num_tokens > 0)
    return nullArgument("tokens");
  if (!text && capacity > 0)
    return nullArgument("text");
  if (!out_bytes)
    return nullArgument("out_bytes");
  return guarded([&] {
    std::string decoded = tokenizer->impl->decode(std::vector<int32_t>(tokens, tokens + num_tokens));
    std::memcpy(text, decoded.data(), std::min(capacity, decoded.size()));
    *out_bytes = decoded.size();
  });
}

loom_status_t *loom_token_decoder_create(const loom_tokenizer_t *tokenizer, loom_token_decoder_t **out_decoder) {
  if (!tokenizer)
    return nullArgument("tokenizer");
  if (!out_decoder)
    return nullArgument("out_decoder");
  *out_decoder = nullptr;
  return guarded([&] { *out_decoder = new loom_token_decoder_t{loom::rt::Tokenizer::StreamDecoder(*tokenizer->impl), {}}; });
}

void loom_token_decoder_destroy(loom_token_decoder_t *decoder) { delete decoder; }

loom_status_t *loom_token_decoder_push(loom_token_decoder_t *decoder, int32_t token, const char **out_text,
                                       size_t *out_bytes) {
  if (!decoder)
    return nullArgument("decoder");
  if (!out_text)
    return nullArgument("out_text");
  return guarded([&] {
    decoder->piece = decoder->stream.push(token);
    *out_text = decoder->piece.c_str();
    if (out_bytes)
      *out_bytes = decoder->piece.size();
  });
}

loom_status_t *loom_token_decoder_finish(loom_token_decoder_t *decoder, const char **out_text, size_t *out_bytes) {
  if (!decoder)
    return nullArgument("decoder");
  if (!out_text)
    return nullArgument("out_text");
  return guarded([&] {
    decoder->piece = decoder->stream.finish();
    *out_text = decoder->piece.c_str();
    if (out_bytes)
      *out_bytes = decoder->piece.size();
  });
}

} // extern "C"
