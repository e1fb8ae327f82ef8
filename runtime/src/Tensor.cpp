//===- Tensor.cpp - Element types and shapes ------------------------------===//

#include "loom/rt/Tensor.h"
#include "loom/rt/Checked.h"

namespace loom::rt {

namespace {
struct DtypeNames {
  loom_dtype_t type;
  const char *loom;
  const char *safetensors;
};
constexpr DtypeNames kDtypes[] = {
    {LOOM_F32, "f32", "F32"},   {LOOM_F64, "f64", "F64"}, {LOOM_BF16, "bf16", "BF16"},
    {LOOM_F16, "f16", "F16"},   {LOOM_I32, "i32", "I32"}, {LOOM_I64, "i64", "I64"},
};
} // namespace

const char *dtypeName(loom_dtype_t t) {
  for (auto &d : kDtypes)
    if (d.type == t)
      return d.loom;
  return "?";
}

const char *safetensorsDtype(loom_dtype_t t) {
  for (auto &d : kDtypes)
    if (d.type == t)
      return d.safetensors;
  return "?";
}

std::optional<loom_dtype_t> parseDtype(const std::string &name) {
  for (auto &d : kDtypes)
    if (name == d.loom)
      return d.type;
  return std::nullopt;
}

std::optional<loom_dtype_t> parseSafetensorsDtype(const std::string &name) {
  for (auto &d : kDtypes)
    if (name == d.safetensors)
      return d.type;
  return std::nullopt;
}

std::optional<int64_t> numElements(const Shape &shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    std::optional<int64_t> next = d < 0 ? std::nullopt : checkedMul(n, d);
    if (!next || *next > kMaxElements)
      return std::nullopt;
    n = *next;
  }
  return n;
}

std::string shapeStr(const Shape &shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

} // namespace loom::rt
