//===- HfImport.cpp - Hugging Face checkpoint -> Loom model and weights ---===//
//
// A checkpoint directory as transformers' save_pretrained writes it:
// config.json, then model.safetensors or model.safetensors.index.json with
// its shards, and tokenizer.json (byte-level BPE) or tokenizer.model
// (SentencePiece). Weights are read and written one tensor at a time, so a
// checkpoint larger than memory imports.
//
//===----------------------------------------------------------------------===//

#include "compiler/import/HfCheckpoint.h"
#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"
#include "loom/rt/Tokenizer.h"

#include <filesystem>
#include <map>
#include <memory>
#include <set>

using namespace mlir::loom;
using json = nlohmann::json;
namespace rt = ::loom::rt;
namespace fs = std::filesystem;

namespace {

json readJsonFile(const std::string &path) {
  std::vector<char> bytes = rt::readWholeFile(path);
  json doc = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded())
    rt::fail(LOOM_INVALID_ARGUMENT, path, ": not valid JSON");
  return doc;
}

/// The checkpoint's tensors by name, each in the shard that holds it.
struct CheckpointTensors {
  std::vector<std::unique_ptr<rt::SafetensorsIndex>> shards;
  std::map<std::string, const rt::SafetensorsIndex *> where;
};

CheckpointTensors indexCheckpoint(const std::string &dir) {
  CheckpointTensors out;
  std::string single = dir + "/model.safetensors", sharded = dir + "/model.safetensors.index.json";
  std::vector<std::string> files;
  if (fs::exists(single)) {
    files.push_back("model.safetensors");
  } else if (fs::exists(sharded)) {
    json index = readJsonFile(sharded);
    if (!index.is_object() || !index.contains("weight_map") || !index.at("weight_map").is_object())
      rt::fail(LOOM_INVALID_ARGUMENT, sharded, ": field 'weight_map' is missing or not an object");
    std::set<std::string> seen;
    for (auto &[name, file] : index.at("weight_map").items()) {
      if (!file.is_string())
        rt::fail(LOOM_INVALID_ARGUMENT, sharded, ": field 'weight_map.", name,
                 "' must be a file name, got ", file.dump());
      std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        rt::fail(LOOM_INVALID_ARGUMENT, sharded, ": field 'weight_map.", name, "' is '", f,
                 "': shards must be files in the checkpoint's directory");
      if (seen.insert(f).second)
        files.push_back(f);
    }
  } else {
    rt::fail(LOOM_INVALID_ARGUMENT, dir, " has neither model.safetensors nor "
             "model.safetensors.index.json (Loom reads safetensors checkpoints; save with "
             "save_pretrained(..., safe_serialization=True))");
  }
  for (const std::string &f : files) {
    out.shards.push_back(std::make_unique<rt::SafetensorsIndex>(rt::readSafetensorsIndex(dir + "/" + f)));
    for (const auto &[name, entry] : out.shards.back()->tensors)
      if (!out.where.emplace(name, out.shards.back().get()).second)
        rt::fail(LOOM_INVALID_ARGUMENT, dir, "/", f, ": tensor '", name,
                 "' is also in another shard");
  }
  return out;
}

/// The checkpoint's name for a tensor: GPT-2 files saved from the original
/// release name them without the "transformer." prefix.
std::string findName(const CheckpointTensors &ckpt, const std::string &hfName) {
  if (ckpt.where.count(hfName))
    return hfName;
  const std::string prefix = "transformer.";
  if (hfName.compare(0, prefix.size(), prefix) == 0 && ckpt.where.count(hfName.substr(prefix.size())))
    return hfName.substr(prefix.size());
  return "";
}

/// The tokenizer the checkpoint carries, copied beside the model and checked
/// by loading it. SentencePiece first: Llama 2 checkpoints carry both, and
/// their tokenizer.json is a SentencePiece-style BPE Loom does not read.
std::string importTokenizer(const std::string &dir, const std::string &modelPath) {
  for (const char *name : {"tokenizer.model", "tokenizer.json"}) {
    std::string src = dir + "/" + name;
    if (!fs::exists(src))
      continue;
    std::string ext = fs::path(name).extension().string();
    fs::path model(modelPath);
    fs::path dst = model.parent_path() / (model.stem().string() + ".tokenizer" + ext);
    if (ext == ".json" || rt::Tokenizer::sentencePieceAvailable()) {
      try { // a tokenizer Loom cannot read is refused now, not when serving
        rt::Tokenizer::load(src);
      } catch (const rt::Error &e) {
        rt::fail(e.code, e.what(), " (loomc import --no-tokenizer imports the model without it)");
      }
    }
    std::vector<char> bytes = rt::readWholeFile(src);
    rt::writeFileAtomically(dst.string(), bytes.data(), bytes.size());
    return dst.string();
  }
  return "";
}

} // namespace

ImportResult mlir::loom::importHfCheckpoint(const ImportOptions &o) {
  if (o.dtype != "f32" && o.dtype != "bf16")
    rt::fail(LOOM_INVALID_ARGUMENT, "--dtype must be f32 or bf16, got '", o.dtype, "'");
  if (!fs::is_directory(o.dir))
    rt::fail(LOOM_INVALID_ARGUMENT, "'", o.dir, "' is not a checkpoint directory");
  std::string configPath = o.dir + "/config.json";
  json doc = readJsonFile(configPath);
  ImportResult result;
  result.config = readHfConfig(doc, configPath, o.seq);
  ModelConfig &c = result.config;
  c.dtype = o.dtype;
  result.architecture = doc.at("architectures")[0].get<std::string>();

  // Every tensor Loom needs, of the shape the config implies; nothing else.
  CheckpointTensors ckpt = indexCheckpoint(o.dir);
  std::vector<HfTensorMap> maps = hfTensorMaps(c);
  std::vector<std::string> sourceNames;
  std::set<std::string> used;
  for (const HfTensorMap &m : maps) {
    std::string name = findName(ckpt, m.hfName);
    if (name.empty())
      rt::fail(LOOM_INVALID_ARGUMENT, o.dir, ": tensor '", m.hfName, "' (Loom's '", m.loomName,
               "') is missing from the checkpoint");
    const rt::SafetensorsEntry &e = ckpt.where.at(name)->tensors.at(name);
    bool fits = m.transform == HfTransform::FirstRows
                    ? e.shape.size() == 2 && e.shape[0] >= m.hfShape[0] && e.shape[1] == m.hfShape[1]
                    : e.shape == m.hfShape;
    if (!fits)
      rt::fail(LOOM_INVALID_ARGUMENT, ckpt.where.at(name)->path, ": tensor '", name, "' is ",
               rt::shapeStr(e.shape), " but ", configPath, " implies ", rt::shapeStr(m.hfShape));
    if (e.dtype != LOOM_F32 && e.dtype != LOOM_BF16 && e.dtype != LOOM_F16 && e.dtype != LOOM_F64)
      rt::fail(LOOM_UNSUPPORTED, ckpt.where.at(name)->path, ": tensor '", name, "' is ",
               rt::dtypeName(e.dtype), ": Loom imports floating-point weights (F32, F64, BF16, F16)");
    sourceNames.push_back(name);
    used.insert(name);
  }
  for (const auto &[name, index] : ckpt.where)
    if (!used.count(name) && !isIgnoredHfTensor(c, name))
      rt::fail(LOOM_INVALID_ARGUMENT, index->path, ": tensor '", name, "' has no place in a ",
               result.architecture, " of ", configPath,
               "'s configuration (does the config belong to these weights?)");

  c.origin = "// Imported by: loomc import " + o.dir + " (" + result.architecture + ") --dtype " +
             o.dtype + (o.seq ? " --seq " + std::to_string(o.seq) : "");
  if (o.tokenizer)
    result.tokenizerPath = importTokenizer(o.dir, o.modelPath);
  if (!result.tokenizerPath.empty())
    c.tokenizer = fs::path(result.tokenizerPath).filename().string();
  std::string text, error;
  if (!writeModel(c, text, error))
    rt::fail(LOOM_INVALID_ARGUMENT, configPath, ": ", error);

  loom_dtype_t out = o.dtype == "bf16" ? LOOM_BF16 : LOOM_F32;
  std::vector<rt::SafetensorsSpec> specs;
  for (const HfTensorMap &m : maps)
    specs.push_back({m.loomName, out, m.loomShape});
  rt::writeSafetensorsStreaming(
      o.weightsPath, specs, {{"model", fs::path(o.modelPath).stem().string()}, {"source", o.dir}},
      [&](size_t i, std::vector<char> &bytes) {
        const rt::SafetensorsIndex &index = *ckpt.where.at(sourceNames[i]);
        const rt::SafetensorsEntry &e = index.tensors.at(sourceNames[i]);
        // One statement a step, so that at most two copies of the tensor live at once.
        std::vector<float> values = toFloats(rt::readSafetensorsTensor(index, sourceNames[i]),
                                             e.dtype, index.path + ": tensor '" + sourceNames[i] + "'");
        values = hfToLoom(maps[i], std::move(values));
        bytes = fromFloats(values, out);
        result.bytes += static_cast<int64_t>(bytes.size());
      });
  result.tensors = static_cast<int64_t>(maps.size());
  rt::writeFileAtomically(o.modelPath, text.data(), text.size());
  return result;
}
