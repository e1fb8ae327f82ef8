//===- HfCheckpoint.h - Hugging Face checkpoints in Loom's terms -*- C++ -*-===//
//
// What `loomc import` and `loomc export` share: a transformers config.json
// read into a ModelConfig (and written back from one), and the table that
// pairs each Loom parameter with its Hugging Face tensor and the transform
// between their layouts.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_COMPILER_IMPORT_HFCHECKPOINT_H
#define LOOM_COMPILER_IMPORT_HFCHECKPOINT_H

#include "compiler/ModelZoo.h"
#include "loom/rt/Tensor.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace mlir::loom {

/// How a Hugging Face tensor becomes a Loom parameter.
enum class HfTransform {
  Copy,            // same layout (GPT-2's Conv1D weights are already [in, out])
  Transpose,       // nn.Linear [out, in] -> Loom [in, out]
  RotaryTranspose, // q/k projections: each head's rows from halves to adjacent pairs, then transposed
  FirstRows,       // GPT-2's position table cut to the model's sequence length
};

struct HfTensorMap {
  std::string loomName, hfName;
  HfTransform transform;
  ::loom::rt::Shape hfShape, loomShape;
  int64_t headDim = 0; // RotaryTranspose
};

/// The family, sizes and constants of a GPT2LMHeadModel or LlamaForCausalLM
/// config. `seq` (0: the config's position count) shortens the model's
/// sequence. Throws rt::Error naming `path` and the field at fault.
ModelConfig readHfConfig(const nlohmann::json &config, const std::string &path, int64_t seq);

/// The config.json that describes `config` to transformers.
nlohmann::json writeHfConfig(const ModelConfig &config);

/// Every Loom parameter of `config` with its Hugging Face tensor.
std::vector<HfTensorMap> hfTensorMaps(const ModelConfig &config);

/// Hugging Face tensors a checkpoint may hold that Loom does not use: GPT-2's
/// causal-mask buffers, a tied head's copy of the embeddings, rotary caches.
bool isIgnoredHfTensor(const ModelConfig &config, const std::string &hfName);

/// Elements of `bytes` (f32, f64, bf16 or f16) as f32; throws for other dtypes.
std::vector<float> toFloats(const std::vector<char> &bytes, loom_dtype_t dtype,
                            const std::string &what);
/// f32 values as `dtype` (f32 or bf16) bytes.
std::vector<char> fromFloats(const std::vector<float> &values, loom_dtype_t dtype);

/// Applies `map`'s transform to Hugging Face values (import) or its inverse
/// to Loom values (export).
/// Values are taken by value so that a copy needs no second buffer.
std::vector<float> hfToLoom(const HfTensorMap &map, std::vector<float> hf);
std::vector<float> loomToHf(const HfTensorMap &map, std::vector<float> loom);

struct ImportOptions {
  std::string dir;         // config.json, model.safetensors or its sharded index, tokenizer
  std::string modelPath;   // the model file to write
  std::string weightsPath; // its weights, under Loom's names
  std::string dtype = "f32";
  int64_t seq = 0; // 0: the checkpoint's position count
  bool tokenizer = true; // import tokenizer.model or tokenizer.json when there is one
};

struct ImportResult {
  ModelConfig config;
  std::string architecture;
  int64_t tensors = 0, bytes = 0;
  std::string tokenizerPath; // the tokenizer copied beside the model, or ""
};

/// Reads a Hugging Face checkpoint directory tensor by tensor and writes a
/// model file (through writeModel) and its weights. Throws rt::Error naming
/// the file and field at fault.
ImportResult importHfCheckpoint(const ImportOptions &options);

struct ExportOptions {
  std::string bundleDir;   // the model's shape and constants (its manifest)
  std::string weightsPath; // "": the bundle's own weights
  std::string outDir;
};

/// Writes config.json, model.safetensors and the bundle's tokenizer, if it
/// has one, so that transformers' from_pretrained loads them. Returns the
/// configuration written.
ModelConfig exportHfCheckpoint(const ExportOptions &options);

} // namespace mlir::loom

#endif
