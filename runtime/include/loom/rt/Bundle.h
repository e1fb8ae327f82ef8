//===- Bundle.h - The bundle: the compiler's only output --------*- C++ -*-===//
//
// A bundle is a directory: manifest.json (format, version, per-rank buffers
// and instruction streams) and weights.safetensors. docs/bundle-format.md
// documents every field. The reader validates all of it and names the file
// and field at fault; the writer is used by loomc.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_BUNDLE_H
#define LOOM_RUNTIME_BUNDLE_H

#include "loom/rt/Tensor.h"

#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace loom::rt {

constexpr int kBundleVersion = 1;
constexpr const char *kBundleFormat = "loom-bundle";

/// State: optimizer moments and the step counter, kept across steps and
/// saved in checkpoints like parameters. Cache: kept across runs but never
/// saved: a serving bundle's key/value cache, and the copies of parameters
/// its "prepare" program casts once (zero when the session starts).
enum class BufferRole { Input, Output, Param, Activation, State, Cache };
const char *roleName(BufferRole role);

struct Buffer {
  int64_t id = 0;
  std::string name;
  loom_dtype_t dtype = LOOM_F32;
  Shape shape;
  int64_t offset = 0; // into the rank's arena
  int64_t bytes = 0;
  BufferRole role = BufferRole::Activation;
  int64_t viewOf = -1; // a reshape: same storage as that buffer
  /// A slice view: the view starts this many bytes into the buffer it views
  /// and may be shorter (0, and the viewed buffer's size, for a reshape).
  int64_t viewOffset = 0;
};

struct Instruction {
  std::string op;
  std::vector<int64_t> in, out;
  nlohmann::json attrs = nlohmann::json::object();
};

struct NamedBuffer {
  std::string name;
  int64_t buffer = 0;
  /// For integer inputs that index something (token ids, class labels): the
  /// exclusive upper bound of valid values; 0 when unbounded.
  int64_t limit = 0;
};

struct ParamInit {
  std::string kind; // zeros, ones, normal, uniform, constant
  double scale = 0;
};

/// This rank's part of a parameter split by tensor parallelism: dimension
/// `axis` of `fullShape` is viewed as `blocks` equal blocks (3 for a fused
/// q|k|v weight), and each block is cut into `parts` equal slices, of which
/// the rank holds slice `index` of every block. Initialisers and weight files
/// describe the full tensor; every rank takes its part.
///
/// ZeRO-3 then splits that part (or the whole parameter, with axis -1)
/// over the data-parallel ranks: flattened and padded with zeros to a
/// multiple of `zeroParts` elements, it is cut into `zeroParts` equal
/// chunks, of which the rank holds chunk `zeroIndex` as a 1-D buffer (the
/// layout of `shard_of` and `all_gather`).
struct ParamShard {
  int64_t axis = -1; // -1: the rank holds the whole parameter
  int64_t parts = 1, index = 0, blocks = 1;
  Shape fullShape;
  int64_t zeroParts = 1, zeroIndex = 0;
  /// Whether the rank holds less than the whole parameter.
  bool split() const { return axis >= 0 || zeroParts > 1; }
  /// The tensor-parallel part's shape (fullShape when axis is -1).
  Shape partShape() const;
};

struct Parameter {
  std::string name;
  int64_t buffer = 0;
  ParamInit init;
  int64_t grad = -1; // the gradient's buffer in a training bundle (valid after backward)
  ParamShard shard;
};

/// Copies this rank's part of a full tensor (laid out densely in
/// shard.fullShape) into `part`, or the part back into the full tensor.
void extractShard(const ParamShard &shard, size_t elementSize, const char *full, char *part);
void insertShard(const ParamShard &shard, size_t elementSize, const char *part, char *full);

struct RankProgram {
  int64_t rank = 0;
  std::string device = "cpu";
  int64_t arenaBytes = 0;
  int64_t peakActivationBytes = 0;
  std::vector<Buffer> buffers; // indexed by id
  std::vector<NamedBuffer> inputs, outputs;
  std::vector<Parameter> params;
  std::vector<NamedBuffer> state; // optimizer state and step counter (training)
  std::map<std::string, std::vector<Instruction>> programs; // "forward", "backward", "update"
  /// Communication groups by name ("dp", "tp", "pp", "mp", ...): the global
  /// ranks of each group this rank belongs to, in order. Collective
  /// instructions name one with their "group" attribute.
  std::map<std::string, std::vector<int64_t>> groups;
  /// The rank's place in the plan: {"dp": i, "tp": j, "pp": k}.
  std::map<std::string, int64_t> coords;
};

/// The buffer whose storage `id` uses: itself, or the root its views lead to.
inline int64_t storageOf(const RankProgram &r, int64_t id) {
  while (r.buffers[id].viewOf >= 0)
    id = r.buffers[id].viewOf;
  return id;
}

/// One program of a serving bundle: a step over `tokens` token slots (any
/// mix of prompt chunks and decoding sequences) that computes the logits of
/// `rows` of them. Its inputs are named "<name>.tokens" [1, tokens],
/// "<name>.positions" [1, tokens], "<name>.slots" [tokens] (cache row of each
/// token, -1 for padding), "<name>.block_table" [tokens, max_blocks_per_seq]
/// and "<name>.rows" [rows] (which tokens' logits); its output
/// "<name>.logits" [1, rows, vocab].
struct ServeProgram {
  std::string name;
  int64_t tokens = 0, rows = 0;
};
/// What a serving bundle (`loomc compile --serve`) tells the runtime's
/// scheduler: the paged key/value cache's geometry and the step programs.
struct ServeConfig {
  int64_t blockSize = 0, numBlocks = 0, maxBlocksPerSeq = 0;
  int64_t maxSeq = 0, maxBatch = 0, vocab = 0;
  /// By tokens, ascending.
  std::vector<ServeProgram> programs;
  /// Run once before the first step (casts of parameters); "" when none.
  std::string prepare;
  bool enabled() const { return !programs.empty(); }
};
nlohmann::json toJson(const ServeConfig &serve);
struct Manifest;
/// Reads a manifest's "serve" section and checks it against the ranks'
/// programs and bindings; throws Error naming `where` and the field.
ServeConfig parseServeConfig(const nlohmann::json &doc, const Manifest &m, const std::string &where);

struct Manifest {
  int version = kBundleVersion;
  std::string model;
  std::string mode = "infer";
  int64_t batch = 1;
  std::string weights = "weights.safetensors"; // "": initialise from `seed` on load
  /// PTX of the fused kernels ("kernels.ptx"), or "" when nothing was fused.
  std::string kernels;
  /// The tokenizer that travels with the model ("tokenizer.json": byte-level
  /// BPE; "tokenizer.model": SentencePiece), a file in the bundle, or "".
  std::string tokenizer;
  uint64_t seed = 0;
  /// The parallel plan the bundle was compiled for (as `loomc plan --json`
  /// writes it, or the degrees that were forced); empty for one device.
  nlohmann::json plan = nlohmann::json::object();
  /// Serving bundles (mode "serve") only.
  ServeConfig serve;
  std::vector<RankProgram> ranks;
};

/// The communicators a multi-GPU run of the manifest needs: one for each
/// distinct member list of the groups its collectives name (a group no
/// instruction names needs none: each costs about 1 GiB of GPU memory with
/// every connection made at creation), and one for each directed pair of
/// ranks a send crosses. The runtime creates these; the planner predicts
/// how many a rank joins (`loom::planner::communicatorsPerRank`).
struct Communicators {
  std::set<std::vector<int>> groups;
  std::set<std::pair<int, int>> links; // (from, to)
  /// How many of them `rank` belongs to.
  int64_t joinedBy(int rank) const;
};
Communicators communicatorsOf(const Manifest &m);

/// Reads DIR/manifest.json and validates it: every buffer in its arena, every
/// instruction's buffers defined, names unique. Throws Error naming the field.
Manifest readManifest(const std::string &bundleDir);
Manifest parseManifest(const nlohmann::json &doc, const std::string &where);

nlohmann::json toJson(const Manifest &manifest);
/// Writes DIR/manifest.json atomically (creating DIR if needed).
void writeManifest(const Manifest &manifest, const std::string &bundleDir);

} // namespace loom::rt

#endif
