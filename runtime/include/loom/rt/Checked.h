//===- Checked.h - Arithmetic on sizes that refuses to overflow -*- C++ -*-===//
//
// Every size and offset read from a bundle, a safetensors file or a
// checkpoint, or computed from a shape, is combined through these: a wrapped
// int64 passes bounds checks and then sends memcpy far outside its buffer.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_CHECKED_H
#define LOOM_RUNTIME_CHECKED_H

#include <cstdint>
#include <optional>

namespace loom::rt {

/// a + b, or nullopt where it does not fit in int64.
inline std::optional<int64_t> checkedAdd(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out))
    return std::nullopt;
  return out;
}

/// a * b, or nullopt where it does not fit in int64.
inline std::optional<int64_t> checkedMul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out))
    return std::nullopt;
  return out;
}

/// v rounded up to a multiple of `alignment` (> 0), or nullopt on overflow.
inline std::optional<int64_t> checkedAlignUp(int64_t v, int64_t alignment) {
  std::optional<int64_t> up = checkedAdd(v, alignment - 1);
  if (!up)
    return std::nullopt;
  return *up / alignment * alignment;
}

} // namespace loom::rt

#endif
