//===- HfExport.cpp - Loom bundle or checkpoint -> Hugging Face checkpoint -===//
//
// The inverse of loomc import. The bundle's manifest says what the weights
// cannot: heads (the attention instructions', times the tensor-parallel
// degree they were split over), the rotary base and the norms' epsilon. The
// weights come from the bundle's file or from a checkpoint loom-run wrote for
// it, and are written one tensor at a time.
//
//===----------------------------------------------------------------------===//

#include "compiler/import/HfCheckpoint.h"
#include "loom/rt/Bundle.h"
#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"

#include <filesystem>

using namespace mlir::loom;
using json = nlohmann::json;
namespace rt = ::loom::rt;
namespace fs = std::filesystem;

namespace {

/// The first instruction of `op` in any rank's programs, or null.
const rt::Instruction *firstInstruction(const rt::Manifest &m, const std::string &op) {
  for (const rt::RankProgram &rank : m.ranks)
    for (const auto &[name, program] : rank.programs)
      for (const rt::Instruction &ins : program)
        if (ins.op == op)
          return &ins;
  return nullptr;
}

ModelConfig configOf(const rt::Manifest &m, const rt::SafetensorsIndex &weights,
                     const std::string &bundleDir) {
  auto shapeOf = [&](const std::string &name) -> const rt::Shape & {
    auto it = weights.tensors.find(name);
    if (it == weights.tensors.end())
      rt::fail(LOOM_INVALID_ARGUMENT, weights.path, ": has no parameter '", name, "'");
    return it->second.shape;
  };
  ModelConfig c;
  if (weights.tensors.count("wte") && weights.tensors.count("wpe"))
    c.family = "gpt";
  else if (weights.tensors.count("embed") && weights.tensors.count("norm.g"))
    c.family = "llama";
  else
    rt::fail(LOOM_UNSUPPORTED, weights.path, ": neither a GPT-2 (wte, wpe) nor a Llama-style "
             "(embed, norm.g) model; loomc export writes those two");
  const rt::Shape &table = shapeOf(c.family == "gpt" ? "wte" : "embed");
  if (table.size() != 2)
    rt::fail(LOOM_INVALID_ARGUMENT, weights.path, ": the embedding table is ", rt::shapeStr(table));
  c.vocab = table[0], c.hidden = table[1];
  while (weights.tensors.count("layer." + std::to_string(c.layers) +
                               (c.family == "gpt" ? ".ln1.g" : ".attn_norm.g")))
    ++c.layers;
  auto dim = [&](const std::string &name, size_t axis) {
    const rt::Shape &s = shapeOf(name);
    if (s.size() != 2)
      rt::fail(LOOM_INVALID_ARGUMENT, weights.path, ": '", name, "' is ", rt::shapeStr(s));
    return s[axis];
  };
  // Heads per rank times the ranks a tensor-parallel plan split them over.
  const rt::Instruction *attention = firstInstruction(m, "attention");
  if (!attention || c.layers == 0)
    rt::fail(LOOM_INVALID_ARGUMENT, bundleDir, ": the bundle has no attention layers");
  int64_t tp = m.plan.is_object() ? m.plan.value("tp", int64_t(1)) : 1;
  c.heads = attention->attrs.value("num_heads", int64_t(0)) * tp;
  const rt::Instruction *norm = firstInstruction(m, c.family == "gpt" ? "layernorm" : "rmsnorm");
  if (c.family == "gpt") {
    c.seq = dim("wpe", 0);
    c.ffn = dim("layer.0.mlp.fc.w", 1);
    c.normEps = norm ? norm->attrs.value("eps", 1e-5) : 1e-5;
  } else {
    c.kvHeads = attention->attrs.value("num_kv_heads", c.heads / tp) * tp;
    c.ffn = dim("layer.0.w_gate", 1);
    c.tiedHead = !weights.tensors.count("lm_head");
    c.normEps = norm ? norm->attrs.value("eps", 1e-6) : 1e-6;
    const rt::Instruction *rotary = firstInstruction(m, "rotary");
    c.ropeTheta = rotary ? rotary->attrs.value("theta", 10000.0) : 10000.0;
    // The sequence is the token input's second dimension.
    c.seq = 0;
    for (const rt::NamedBuffer &in : m.ranks.front().inputs)
      if (in.name == "tokens" && m.ranks.front().buffers[in.buffer].shape.size() == 2)
        c.seq = m.ranks.front().buffers[in.buffer].shape[1];
    if (c.seq == 0)
      rt::fail(LOOM_INVALID_ARGUMENT, bundleDir, ": rank 0 has no [batch, seq] input 'tokens'");
  }
  if (c.heads <= 0 || c.hidden % c.heads != 0 || (c.family == "llama" && (c.kvHeads <= 0 ||
                                                                           c.heads % c.kvHeads)))
    rt::fail(LOOM_INVALID_ARGUMENT, bundleDir, ": attention has ", c.heads, " heads (",
             c.kvHeads, " key/value heads) for width ", c.hidden);
  return c;
}

} // namespace

ModelConfig mlir::loom::exportHfCheckpoint(const ExportOptions &o) {
  rt::Manifest manifest = rt::readManifest(o.bundleDir);
  std::string weightsPath = o.weightsPath;
  if (weightsPath.empty()) {
    if (manifest.weights.empty())
      rt::fail(LOOM_INVALID_ARGUMENT, o.bundleDir, ": the bundle has no weights file (compiled "
               "with --no-weights); export a checkpoint of it: loomc export CHECKPOINT "
               "--bundle ", o.bundleDir, " --to DIR");
    weightsPath = o.bundleDir + "/" + manifest.weights;
  }
  rt::SafetensorsIndex weights = rt::readSafetensorsIndex(weightsPath);
  ModelConfig c = configOf(manifest, weights, o.bundleDir);

  std::vector<HfTensorMap> maps = hfTensorMaps(c);
  // bf16 weights stay bf16; anything else is written as f32.
  loom_dtype_t dtype = weights.tensors.count(maps.front().loomName) &&
                               weights.tensors.at(maps.front().loomName).dtype == LOOM_BF16
                           ? LOOM_BF16
                           : LOOM_F32;
  c.dtype = dtype == LOOM_BF16 ? "bf16" : "f32";
  std::vector<rt::SafetensorsSpec> specs;
  for (const HfTensorMap &m : maps) {
    auto it = weights.tensors.find(m.loomName);
    if (it == weights.tensors.end())
      rt::fail(LOOM_INVALID_ARGUMENT, weightsPath, ": has no parameter '", m.loomName, "'");
    if (it->second.shape != m.loomShape)
      rt::fail(LOOM_INVALID_ARGUMENT, weightsPath, ": parameter '", m.loomName, "' is ",
               rt::shapeStr(it->second.shape), " but the bundle's model implies ",
               rt::shapeStr(m.loomShape));
    specs.push_back({m.hfName, dtype, m.hfShape});
  }

  std::error_code ec;
  fs::create_directories(o.outDir, ec);
  if (ec || !fs::is_directory(o.outDir))
    rt::fail(LOOM_IO_ERROR, "cannot create '", o.outDir, "': ", ec.message());
  rt::writeSafetensorsStreaming(
      o.outDir + "/model.safetensors", specs, {{"format", "pt"}},
      [&](size_t i, std::vector<char> &bytes) {
        const rt::SafetensorsEntry &e = weights.tensors.at(maps[i].loomName);
        std::vector<float> values = toFloats(rt::readSafetensorsTensor(weights, maps[i].loomName),
                                             e.dtype, weightsPath + ": '" + maps[i].loomName + "'");
        values = loomToHf(maps[i], std::move(values));
        bytes = fromFloats(values, dtype);
      });
  std::string config = writeHfConfig(c).dump(2) + "\n";
  rt::writeFileAtomically(o.outDir + "/config.json", config.data(), config.size());
  if (!manifest.tokenizer.empty()) {
    std::vector<char> bytes = rt::readWholeFile(o.bundleDir + "/" + manifest.tokenizer);
    std::string name = fs::path(manifest.tokenizer).extension() == ".json" ? "tokenizer.json"
                                                                            : "tokenizer.model";
    rt::writeFileAtomically(o.outDir + "/" + name, bytes.data(), bytes.size());
  }
  return c;
}
