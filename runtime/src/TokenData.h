//===- TokenData.h - Token files for language-model training ----*- C++ -*-===//
//
// A token file is a flat array of uint16 or uint32 ids, as nanoGPT's data
// scripts write. Every id is checked against the vocabulary when the file is
// read, so a wrong tokenizer or --data-dtype is an error, not a bad gather.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_TOKENDATA_H
#define LOOM_RUNTIME_TOKENDATA_H

#include <cstdint>
#include <string>
#include <vector>

namespace loom::rt {

/// Token windows of a language-model data file: example j of step t reads
/// ids [off, off + seq) as tokens and [off + 1, off + seq + 1) as targets.
class TokenData {
public:
  /// Reads `path`; `dtype` is "uint16" or "uint32", `vocab` 0 for no check.
  TokenData(const std::string &path, const std::string &dtype, int64_t batch, int64_t seq,
            int64_t vocab);
  /// The same from the file's bytes; `path` names it in errors.
  TokenData(const std::vector<char> &raw, const std::string &path, const std::string &dtype,
            int64_t batch, int64_t seq, int64_t vocab);

  /// Fills `in` and `target` (batch x seq each) for step `step` (from 1).
  void fill(int64_t step, std::vector<int32_t> &in, std::vector<int32_t> &target) const;

private:
  int64_t batch, seq;
  std::vector<uint32_t> tokens;
};

} // namespace loom::rt

#endif
