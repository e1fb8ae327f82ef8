//===- TokenData.cpp - Token files for language-model training ------------===//

#include "runtime/src/TokenData.h"
#include "loom/rt/Checked.h"
#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"

#include <cstring>

namespace loom::rt {

namespace {
std::vector<char> readTokenFile(const std::string &path) {
  try {
    return readWholeFile(path);
  } catch (const Error &e) {
    fail(e.code, "cannot open data file: ", e.what());
  }
}
} // namespace

TokenData::TokenData(const std::string &path, const std::string &dtype, int64_t batch,
                     int64_t seq, int64_t vocab)
    : TokenData(readTokenFile(path), path, dtype, batch, seq, vocab) {}

TokenData::TokenData(const std::vector<char> &raw, const std::string &path,
                     const std::string &dtype, int64_t batch, int64_t seq, int64_t vocab)
    : batch(batch), seq(seq) {
  if (dtype != "uint16" && dtype != "uint32")
    fail(LOOM_INVALID_ARGUMENT, "--data-dtype must be uint16 or uint32, got '", dtype, "'");
  if (batch < 1 || seq < 1)
    fail(LOOM_INVALID_ARGUMENT, path, ": batch and sequence length must be positive, got ", batch,
         " x ", seq);
  size_t width = dtype == "uint16" ? 2 : 4;
  if (raw.size() % width)
    fail(LOOM_INVALID_ARGUMENT, path, ": ", raw.size(), " bytes is not a whole number of ", dtype,
         " token ids");
  tokens.resize(raw.size() / width);
  for (size_t i = 0; i < tokens.size(); ++i) {
    uint16_t narrow;
    if (width == 2)
      std::memcpy(&narrow, raw.data() + 2 * i, 2), tokens[i] = narrow;
    else
      std::memcpy(&tokens[i], raw.data() + 4 * i, 4);
    if (vocab > 0 && tokens[i] >= vocab)
      fail(LOOM_INVALID_ARGUMENT, path, ": token id ", tokens[i], " at position ", i,
           " is outside the model's vocabulary of ", vocab, " (wrong tokenizer, or --data-dtype?)");
  }
  std::optional<int64_t> window = checkedMul(batch, seq);
  if (!window || static_cast<int64_t>(tokens.size()) <= *window)
    fail(LOOM_INVALID_ARGUMENT, path, ": ", tokens.size(), " tokens are fewer than one batch of ",
         batch, " x ", seq, " plus one target (", window ? std::to_string(*window + 1) : "more",
         ")");
}

void TokenData::fill(int64_t step, std::vector<int32_t> &in, std::vector<int32_t> &target) const {
  int64_t span = static_cast<int64_t>(tokens.size()) - seq;
  for (int64_t j = 0; j < batch; ++j) {
    // In 128 bits: step x batch x seq passes int64 long before the data wraps.
    int64_t off = static_cast<int64_t>(((__int128(step) - 1) * batch + j) * seq % span);
    for (int64_t i = 0; i < seq; ++i) {
      in[j * seq + i] = static_cast<int32_t>(tokens[off + i]);
      target[j * seq + i] = static_cast<int32_t>(tokens[off + i + 1]);
    }
  }
}

} // namespace loom::rt
