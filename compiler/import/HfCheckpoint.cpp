//===- HfCheckpoint.cpp - Hugging Face checkpoints in Loom's terms --------===//

#include "compiler/import/HfCheckpoint.h"
#include "loom/rt/Error.h"

#include <cmath>
#include <cstring>

using namespace mlir::loom;
using json = nlohmann::json;
namespace rt = ::loom::rt;

namespace {

/// Fields of one config.json, each error naming the file and the field.
class ConfigFields {
public:
  ConfigFields(const json &doc, const std::string &path) : doc(doc), path(path) {}

  [[noreturn]] void bad(const std::string &field, const std::string &what) const {
    rt::fail(LOOM_INVALID_ARGUMENT, path, ": field '", field, "' ", what);
  }
  bool has(const std::string &field) const {
    return doc.contains(field) && !doc.at(field).is_null();
  }
  int64_t positive(const std::string &field) const {
    if (!has(field))
      bad(field, "is missing");
    const json &v = doc.at(field);
    if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > (int64_t(1) << 40))
      bad(field, "must be a positive integer, got " + v.dump());
    return v.get<int64_t>();
  }
  int64_t positiveOr(const std::string &field, int64_t fallback) const {
    return has(field) ? positive(field) : fallback;
  }
  double number(const std::string &field, double fallback, const json &in) const {
    auto it = in.find(field);
    if (it == in.end() || it->is_null())
      return fallback;
    if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() <= 0)
      bad(field, "must be a positive number, got " + it->dump());
    return it->get<double>();
  }
  double number(const std::string &field, double fallback) const {
    return number(field, fallback, doc);
  }
  bool flag(const std::string &field, bool fallback) const {
    if (!has(field))
      return fallback;
    if (!doc.at(field).is_boolean())
      bad(field, "must be true or false, got " + doc.at(field).dump());
    return doc.at(field).get<bool>();
  }
  std::string string(const std::string &field, const std::string &fallback) const {
    if (!has(field))
      return fallback;
    if (!doc.at(field).is_string())
      bad(field, "must be a string, got " + doc.at(field).dump());
    return doc.at(field).get<std::string>();
  }
  /// Refuses a setting Loom's model of the family does not have.
  void require(const std::string &field, bool ok, const std::string &why) const {
    if (!ok)
      bad(field, "is " + doc.at(field).dump() + ": " + why);
  }

  const json &doc;
  const std::string &path;
};

ModelConfig readGpt2(const ConfigFields &f) {
  ModelConfig c;
  c.family = "gpt";
  c.vocab = f.positive("vocab_size");
  c.seq = f.positive("n_positions");
  c.hidden = f.positive("n_embd");
  c.layers = f.positive("n_layer");
  c.heads = f.positive("n_head");
  c.ffn = f.positiveOr("n_inner", 4 * c.hidden);
  c.normEps = f.number("layer_norm_epsilon", 1e-5);
  std::string act = f.string("activation_function", "gelu_new");
  f.require("activation_function",
            act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast",
            "Loom's GPT-2 uses the tanh approximation of GELU (gelu_new)");
  if (f.has("tie_word_embeddings"))
    f.require("tie_word_embeddings", f.flag("tie_word_embeddings", true),
              "Loom's GPT-2 ties its head to the token embeddings");
  if (f.has("scale_attn_weights"))
    f.require("scale_attn_weights", f.flag("scale_attn_weights", true),
              "Loom's attention scales scores by 1/sqrt(head_dim)");
  if (f.has("scale_attn_by_inverse_layer_idx"))
    f.require("scale_attn_by_inverse_layer_idx",
              !f.flag("scale_attn_by_inverse_layer_idx", false),
              "Loom's attention scales every layer alike");
  if (f.has("add_cross_attention"))
    f.require("add_cross_attention", !f.flag("add_cross_attention", false),
              "Loom imports decoder-only GPT-2");
  if (c.hidden % c.heads != 0)
    f.bad("n_head", "must divide n_embd " + std::to_string(c.hidden) + ", got " +
                        std::to_string(c.heads));
  return c;
}

ModelConfig readLlama(const ConfigFields &f) {
  ModelConfig c;
  c.family = "llama";
  c.vocab = f.positive("vocab_size");
  c.seq = f.positive("max_position_embeddings");
  c.hidden = f.positive("hidden_size");
  c.layers = f.positive("num_hidden_layers");
  c.heads = f.positive("num_attention_heads");
  c.kvHeads = f.positiveOr("num_key_value_heads", c.heads);
  c.ffn = f.positive("intermediate_size");
  c.normEps = f.number("rms_norm_eps", 1e-6);
  c.tiedHead = f.flag("tie_word_embeddings", false);
  std::string act = f.string("hidden_act", "silu");
  f.require("hidden_act", act == "silu", "Loom's Llama MLP is SwiGLU (silu)");
  for (const char *bias : {"attention_bias", "mlp_bias"})
    if (f.has(bias))
      f.require(bias, !f.flag(bias, false), "Loom's Llama projections have no biases");
  if (c.hidden % c.heads != 0)
    f.bad("num_attention_heads", "must divide hidden_size " + std::to_string(c.hidden) +
                                     ", got " + std::to_string(c.heads));
  if (f.has("head_dim"))
    f.require("head_dim", f.positive("head_dim") == c.hidden / c.heads,
              "Loom's head dimension is hidden_size / num_attention_heads = " +
                  std::to_string(c.hidden / c.heads));
  if (c.heads % c.kvHeads != 0)
    f.bad("num_key_value_heads", "must divide num_attention_heads " + std::to_string(c.heads) +
                                     ", got " + std::to_string(c.kvHeads));
  if ((c.hidden / c.heads) % 2 != 0)
    f.bad("num_attention_heads", "leaves an odd head dimension " +
                                     std::to_string(c.hidden / c.heads) +
                                     "; rotary embeddings rotate pairs");
  // Rope: transformers 4 writes rope_theta and rope_scaling; 5 writes
  // rope_parameters {rope_type, rope_theta}.
  c.ropeTheta = f.number("rope_theta", 10000.0);
  if (f.has("rope_scaling"))
    f.require("rope_scaling", false, "Loom's rotary embedding has no scaling (only null)");
  if (f.has("rope_parameters")) {
    const json &rope = f.doc.at("rope_parameters");
    if (!rope.is_object())
      f.bad("rope_parameters", "must be an object, got " + rope.dump());
    std::string type = rope.value("rope_type", std::string("default"));
    if (type != "default")
      f.bad("rope_parameters.rope_type", "is '" + type + "': Loom's rotary embedding has no "
                                         "scaling (only 'default')");
    c.ropeTheta = f.number("rope_theta", c.ropeTheta, rope);
  }
  return c;
}

} // namespace

ModelConfig mlir::loom::readHfConfig(const json &doc, const std::string &path, int64_t seq) {
  if (!doc.is_object())
    rt::fail(LOOM_INVALID_ARGUMENT, path, ": not a JSON object");
  ConfigFields f(doc, path);
  if (!doc.contains("architectures") || !doc.at("architectures").is_array() ||
      doc.at("architectures").size() != 1 || !doc.at("architectures")[0].is_string())
    f.bad("architectures", "must list one architecture (GPT2LMHeadModel or LlamaForCausalLM)");
  std::string arch = doc.at("architectures")[0].get<std::string>();
  ModelConfig c;
  if (arch == "GPT2LMHeadModel")
    c = readGpt2(f);
  else if (arch == "LlamaForCausalLM")
    c = readLlama(f);
  else
    f.bad("architectures", "is '" + arch + "': Loom imports GPT2LMHeadModel and LlamaForCausalLM");
  if (seq < 0 || seq > c.seq)
    rt::fail(LOOM_INVALID_ARGUMENT, "--seq ", seq, " must be between 1 and the checkpoint's ",
             c.seq, " positions (", path, ")");
  if (seq > 0)
    c.seq = seq;
  return c;
}

json mlir::loom::writeHfConfig(const ModelConfig &c) {
  std::string dtype = c.dtype == "bf16" ? "bfloat16" : "float32";
  if (c.family == "gpt")
    return {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"vocab_size", c.vocab},
            {"n_positions", c.seq},
            {"n_embd", c.hidden},
            {"n_layer", c.layers},
            {"n_head", c.heads},
            {"n_inner", c.ffn},
            {"activation_function", "gelu_new"},
            {"layer_norm_epsilon", c.normEps > 0 ? c.normEps : 1e-5},
            {"tie_word_embeddings", true},
            {"torch_dtype", dtype}};
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", c.vocab},
          {"max_position_embeddings", c.seq},
          {"hidden_size", c.hidden},
          {"intermediate_size", c.ffn},
          {"num_hidden_layers", c.layers},
          {"num_attention_heads", c.heads},
          {"num_key_value_heads", c.kvHeads},
          {"hidden_act", "silu"},
          {"rms_norm_eps", c.normEps > 0 ? c.normEps : 1e-6},
          {"rope_theta", c.ropeTheta > 0 ? c.ropeTheta : 10000.0},
          {"rope_parameters",
           {{"rope_type", "default"}, {"rope_theta", c.ropeTheta > 0 ? c.ropeTheta : 10000.0}}},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"tie_word_embeddings", c.tiedHead},
          {"torch_dtype", dtype}};
}

std::vector<HfTensorMap> mlir::loom::hfTensorMaps(const ModelConfig &c) {
  using T = HfTransform;
  std::vector<HfTensorMap> maps;
  int64_t h = c.hidden, f = c.ffn, v = c.vocab;
  auto add = [&](std::string loom, std::string hf, T t, rt::Shape hfShape, int64_t headDim = 0) {
    rt::Shape loomShape = hfShape;
    if (t == T::Transpose || t == T::RotaryTranspose)
      loomShape = {hfShape[1], hfShape[0]};
    if (t == T::FirstRows)
      loomShape[0] = c.seq;
    maps.push_back({std::move(loom), std::move(hf), t, std::move(hfShape), loomShape, headDim});
  };
  if (c.family == "gpt") {
    add("wte", "transformer.wte.weight", T::Copy, {v, h});
    // The checkpoint's full position table; the model keeps its first `seq` rows.
    add("wpe", "transformer.wpe.weight", T::FirstRows, {c.seq, h});
    add("ln_f.g", "transformer.ln_f.weight", T::Copy, {h});
    add("ln_f.b", "transformer.ln_f.bias", T::Copy, {h});
    for (int64_t i = 0; i < c.layers; ++i) {
      std::string l = "layer." + std::to_string(i) + ".", p = "transformer.h." + std::to_string(i) + ".";
      add(l + "ln1.g", p + "ln_1.weight", T::Copy, {h});
      add(l + "ln1.b", p + "ln_1.bias", T::Copy, {h});
      add(l + "attn.qkv.w", p + "attn.c_attn.weight", T::Copy, {h, 3 * h});
      add(l + "attn.qkv.b", p + "attn.c_attn.bias", T::Copy, {3 * h});
      add(l + "attn.proj.w", p + "attn.c_proj.weight", T::Copy, {h, h});
      add(l + "attn.proj.b", p + "attn.c_proj.bias", T::Copy, {h});
      add(l + "ln2.g", p + "ln_2.weight", T::Copy, {h});
      add(l + "ln2.b", p + "ln_2.bias", T::Copy, {h});
      add(l + "mlp.fc.w", p + "mlp.c_fc.weight", T::Copy, {h, f});
      add(l + "mlp.fc.b", p + "mlp.c_fc.bias", T::Copy, {f});
      add(l + "mlp.proj.w", p + "mlp.c_proj.weight", T::Copy, {f, h});
      add(l + "mlp.proj.b", p + "mlp.c_proj.bias", T::Copy, {h});
    }
    return maps;
  }
  int64_t d = h / c.heads, kv = c.kvHeads * d;
  add("embed", "model.embed_tokens.weight", T::Copy, {v, h});
  add("norm.g", "model.norm.weight", T::Copy, {h});
  if (!c.tiedHead)
    add("lm_head", "lm_head.weight", T::Copy, {v, h});
  for (int64_t i = 0; i < c.layers; ++i) {
    std::string l = "layer." + std::to_string(i) + ".", p = "model.layers." + std::to_string(i) + ".";
    add(l + "attn_norm.g", p + "input_layernorm.weight", T::Copy, {h});
    add(l + "wq", p + "self_attn.q_proj.weight", T::RotaryTranspose, {h, h}, d);
    add(l + "wk", p + "self_attn.k_proj.weight", T::RotaryTranspose, {kv, h}, d);
    add(l + "wv", p + "self_attn.v_proj.weight", T::Transpose, {kv, h});
    add(l + "wo", p + "self_attn.o_proj.weight", T::Transpose, {h, h});
    add(l + "mlp_norm.g", p + "post_attention_layernorm.weight", T::Copy, {h});
    add(l + "w_gate", p + "mlp.gate_proj.weight", T::Transpose, {f, h});
    add(l + "w_up", p + "mlp.up_proj.weight", T::Transpose, {f, h});
    add(l + "w_down", p + "mlp.down_proj.weight", T::Transpose, {h, f});
  }
  return maps;
}

bool mlir::loom::isIgnoredHfTensor(const ModelConfig &c, const std::string &name) {
  auto endsWith = [&](const std::string &suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (c.family == "gpt")
    return endsWith(".attn.bias") || endsWith(".attn.masked_bias") || name == "lm_head.weight";
  return endsWith("rotary_emb.inv_freq") || (c.tiedHead && name == "lm_head.weight");
}

namespace {
float halfToFloat(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v;
  if (exp == 0)
    v = std::ldexp(static_cast<float>(mant), -24);
  else if (exp == 31)
    v = mant ? NAN : INFINITY;
  else
    v = std::ldexp(static_cast<float>(mant | 0x400), exp - 25);
  return sign ? -v : v;
}
} // namespace

std::vector<float> mlir::loom::toFloats(const std::vector<char> &bytes, loom_dtype_t dtype,
                                        const std::string &what) {
  size_t n = bytes.size() / rt::dtypeSize(dtype);
  std::vector<float> out(n);
  switch (dtype) {
  case LOOM_F32:
    std::memcpy(out.data(), bytes.data(), n * 4);
    break;
  case LOOM_F64:
    for (size_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, bytes.data() + 8 * i, 8);
      out[i] = static_cast<float>(v);
    }
    break;
  case LOOM_BF16:
  case LOOM_F16:
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, bytes.data() + 2 * i, 2);
      out[i] = dtype == LOOM_BF16 ? rt::bf16ToFloat(v) : halfToFloat(v);
    }
    break;
  default:
    rt::fail(LOOM_UNSUPPORTED, what, " is ", rt::dtypeName(dtype),
             ": Loom imports floating-point weights (F32, F64, BF16, F16)");
  }
  return out;
}

std::vector<char> mlir::loom::fromFloats(const std::vector<float> &values, loom_dtype_t dtype) {
  std::vector<char> out(values.size() * rt::dtypeSize(dtype));
  if (dtype == LOOM_F32) {
    std::memcpy(out.data(), values.data(), out.size());
  } else {
    for (size_t i = 0; i < values.size(); ++i) {
      uint16_t v = rt::floatToBf16(values[i]);
      std::memcpy(out.data() + 2 * i, &v, 2);
    }
  }
  return out;
}

namespace {
/// Row r of a [rows, cols] q/k projection in Hugging Face order (each head's
/// first half, then its second) that lands in Loom's row `loomRow` (pairs).
int64_t hfRowOf(int64_t loomRow, int64_t headDim) {
  int64_t head = loomRow / headDim, j = loomRow % headDim;
  return head * headDim + (j % 2 == 0 ? j / 2 : headDim / 2 + j / 2);
}
} // namespace

std::vector<float> mlir::loom::hfToLoom(const HfTensorMap &m, std::vector<float> hf) {
  switch (m.transform) {
  case HfTransform::Copy:
    return hf;
  case HfTransform::FirstRows:
    hf.resize(m.loomShape[0] * m.loomShape[1]);
    return hf;
  case HfTransform::Transpose:
  case HfTransform::RotaryTranspose: {
    int64_t rows = m.hfShape[0], cols = m.hfShape[1];
    std::vector<float> out(hf.size());
    for (int64_t r = 0; r < rows; ++r) {
      int64_t src = m.transform == HfTransform::RotaryTranspose ? hfRowOf(r, m.headDim) : r;
      for (int64_t k = 0; k < cols; ++k)
        out[k * rows + r] = hf[src * cols + k];
    }
    return out;
  }
  }
  return hf;
}

std::vector<float> mlir::loom::loomToHf(const HfTensorMap &m, std::vector<float> loom) {
  switch (m.transform) {
  case HfTransform::Copy:
  case HfTransform::FirstRows: // export writes n_positions = the model's sequence
    return loom;
  case HfTransform::Transpose:
  case HfTransform::RotaryTranspose: {
    int64_t rows = m.hfShape[0], cols = m.hfShape[1];
    std::vector<float> out(loom.size());
    for (int64_t r = 0; r < rows; ++r) {
      int64_t dst = m.transform == HfTransform::RotaryTranspose ? hfRowOf(r, m.headDim) : r;
      for (int64_t k = 0; k < cols; ++k)
        out[dst * cols + k] = loom[k * rows + r];
    }
    return out;
  }
  }
  return loom;
}
