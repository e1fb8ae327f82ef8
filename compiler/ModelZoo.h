//===- ModelZoo.h - Model files of each family and size ---------*- C++ -*-===//
#ifndef LOOM_COMPILER_MODELZOO_H
#define LOOM_COMPILER_MODELZOO_H

#include <cstdint>
#include <string>

namespace mlir::loom {

/// Size of a model. Zero means "the family's default" (see defaultsFor).
struct ModelConfig {
  std::string family; // gpt, llama, bert, mlp, resnet
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kvHeads = 0; // llama: grouped-query attention
  int64_t ffn = 0;     // feed-forward width
  int64_t vocab = 0;
  int64_t seq = 0;
  int64_t inputs = 0;  // mlp: input features
  int64_t classes = 0; // mlp, resnet: output classes
  int64_t image = 0;   // resnet: input height and width
  std::string dtype = "f32";
  // Set by importers (0 / false: the dialect's defaults, which the model
  // files under models/ use and so do not spell out).
  double normEps = 0;    // gpt: layernorm epsilon (1e-5); llama: rmsnorm epsilon (1e-6)
  double ropeTheta = 0;  // llama: rotary base (10000)
  bool tiedHead = false; // llama: the LM head reads the embedding table
  std::string origin;    // replaces the "Written by" line (loomc import names its checkpoint)
  std::string tokenizer; // the module's loom.tokenizer: a file beside the model
};

/// Fills zero fields with the family's defaults: GPT-2 124M, a 1.1B
/// TinyLlama-style decoder, BERT-base, ResNet-50 and a 3-layer MLP.
/// Returns an error message for an unknown family.
std::string applyDefaults(ModelConfig &config);

/// Writes the model file for `config`, or returns false and sets `error`
/// when the configuration is inconsistent (say hidden not divisible by heads).
bool writeModel(const ModelConfig &config, std::string &text, std::string &error);

} // namespace mlir::loom

#endif
