//===- Bundle.cpp - The bundle: the compiler's only output ----------------===//

#include "loom/rt/Bundle.h"
#include "loom/instructions.h"
#include "loom/rt/Checked.h"
#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sys/stat.h>

namespace loom::rt {

using json = nlohmann::json;

const char *roleName(BufferRole role) {
  switch (role) {
  case BufferRole::Input:
    return "input";
  case BufferRole::Output:
    return "output";
  case BufferRole::Param:
    return "param";
  case BufferRole::Activation:
    return "activation";
  case BufferRole::State:
    return "state";
  case BufferRole::Cache:
    return "cache";
  }
  return "?";
}

namespace {

/// Typed access to a JSON object that reports "<file>: <path>: <problem>".
class Field {
public:
  Field(const json &value, std::string path, const std::string &file)
      : value(value), path(std::move(path)), file(file) {}

  [[noreturn]] void bad(const std::string &what) const {
    fail(LOOM_INVALID_BUNDLE, file, ": field '", path, "' ", what);
  }
  /// "<file>: <path>: <what>", for a problem with the whole entry.
  [[noreturn]] void badEntry(const std::string &what, loom_status_code_t code = LOOM_INVALID_BUNDLE) const {
    fail(code, file, ": ", path, ": ", what);
  }
  Field at(const char *key) const {
    if (!value.is_object())
      bad("must be an object");
    auto it = value.find(key);
    if (it == value.end())
      Field(value, path.empty() ? key : path + "." + key, file).bad("is missing");
    return Field(*it, path.empty() ? key : path + "." + key, file);
  }
  bool has(const char *key) const { return value.is_object() && value.contains(key); }
  Field operator[](size_t i) const {
    return Field(value[i], path + "[" + std::to_string(i) + "]", file);
  }
  size_t size() const {
    if (!value.is_array())
      bad("must be a list");
    return value.size();
  }
  int64_t integer(int64_t min = INT64_MIN) const {
    if (!value.is_number_integer())
      bad("must be an integer");
    int64_t v = value.get<int64_t>();
    if (v < min)
      bad("must be at least " + std::to_string(min) + ", got " + std::to_string(v));
    return v;
  }
  double number() const {
    if (!value.is_number())
      bad("must be a number");
    return value.get<double>();
  }
  std::string string() const {
    if (!value.is_string())
      bad("must be a string");
    return value.get<std::string>();
  }
  std::vector<int64_t> integers(int64_t min = INT64_MIN) const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < size(); ++i)
      out.push_back((*this)[i].integer(min));
    return out;
  }
  const json &raw() const { return value; }

private:
  const json &value;
  std::string path;
  const std::string &file;
};

Buffer parseBuffer(const Field &f) {
  Buffer b;
  b.id = f.at("id").integer(0);
  b.name = f.at("name").string();
  std::string dt = f.at("dtype").string();
  std::optional<loom_dtype_t> dtype = parseDtype(dt);
  if (!dtype)
    f.at("dtype").bad("names an unknown dtype '" + dt + "'");
  b.dtype = *dtype;
  b.shape = f.at("shape").integers(0);
  if (b.shape.size() > LOOM_MAX_RANK)
    f.at("shape").bad("has rank above " + std::to_string(LOOM_MAX_RANK));
  b.offset = f.at("offset").integer(0);
  b.bytes = f.at("bytes").integer(0);
  std::string role = f.at("role").string();
  if (role == "input")
    b.role = BufferRole::Input;
  else if (role == "output")
    b.role = BufferRole::Output;
  else if (role == "param")
    b.role = BufferRole::Param;
  else if (role == "activation")
    b.role = BufferRole::Activation;
  else if (role == "state")
    b.role = BufferRole::State;
  else if (role == "cache")
    b.role = BufferRole::Cache;
  else
    f.at("role").bad("must be input, output, param, state, cache or activation, got '" + role + "'");
  if (f.has("view_of"))
    b.viewOf = f.at("view_of").integer(0);
  if (f.has("view_offset"))
    b.viewOffset = f.at("view_offset").integer(0);
  std::optional<int64_t> count = numElements(b.shape);
  if (!count || *count * int64_t(dtypeSize(b.dtype)) != b.bytes)
    f.at("bytes").bad("is " + std::to_string(b.bytes) + " but " + dt + shapeStr(b.shape) +
                      " needs " + (count ? std::to_string(*count * dtypeSize(b.dtype)) : "too many"));
  return b;
}

/// Parameters, inputs, outputs and state live for the whole run, so none may
/// share storage with another buffer; activations may share with each other
/// (the compiler packs them by lifetime). Views share their root's storage.
void checkPersistentOverlap(const RankProgram &r, const Field &buffers) {
  std::vector<const Buffer *> placed;
  for (const Buffer &b : r.buffers)
    if (b.viewOf < 0 && b.bytes > 0)
      placed.push_back(&b);
  std::sort(placed.begin(), placed.end(), [](const Buffer *a, const Buffer *b) {
    return a->offset != b->offset ? a->offset < b->offset : a->id < b->id;
  });
  // Sweeping by offset, a buffer overlaps an earlier one exactly when that
  // one ends past its start: compare with the earlier buffer that reaches
  // furthest, and with the furthest persistent one.
  const Buffer *furthest = nullptr, *furthestPersistent = nullptr;
  auto describe = [](const Buffer &b) {
    return cat(roleName(b.role), " '", b.name, "' (buffer ", b.id, ", bytes [", b.offset, ", ",
               b.offset + b.bytes, "))");
  };
  for (const Buffer *b : placed) {
    bool persistent = b->role != BufferRole::Activation;
    const Buffer *other = persistent ? furthest : furthestPersistent;
    if (other && other->offset + other->bytes > b->offset)
      buffers[size_t(b->id)].at("offset").bad(
          "places " + describe(*b) + " over " + describe(*other) +
          "; parameters, inputs, outputs and state may not share storage");
    if (!furthest || b->offset + b->bytes > furthest->offset + furthest->bytes)
      furthest = b;
    if (persistent &&
        (!furthestPersistent ||
         b->offset + b->bytes > furthestPersistent->offset + furthestPersistent->bytes))
      furthestPersistent = b;
  }
}

/// The instruction set is loom/instructions.def: an op it does not name, a
/// count of buffers outside its range or an attribute it does not list is
/// refused here, before any backend sees the program.
void checkAgainstTable(const Field &f, const Instruction &ins) {
  const InstructionInfo *info = findInstruction(ins.op);
  if (!info)
    f.badEntry("'" + ins.op + "' is not an instruction this runtime knows (loom/instructions.def "
               "lists them; was the bundle written by a newer compiler?)",
               LOOM_UNSUPPORTED);
  std::vector<std::string> names;
  for (auto &[name, _] : ins.attrs.items())
    names.push_back(name);
  std::string problem = checkInstruction(*info, ins.in.size(), ins.out.size(), names);
  if (!problem.empty())
    f.badEntry(problem);
}

RankProgram parseRank(const Field &f, size_t index) {
  RankProgram r;
  r.rank = f.at("rank").integer(0);
  if (r.rank != static_cast<int64_t>(index))
    f.at("rank").bad("must be " + std::to_string(index) + " (ranks are listed in order)");
  r.device = f.at("device").string();
  r.arenaBytes = f.at("arena_bytes").integer(0);
  r.peakActivationBytes = f.at("peak_activation_bytes").integer(0);

  Field buffers = f.at("buffers");
  for (size_t i = 0; i < buffers.size(); ++i) {
    Buffer b = parseBuffer(buffers[i]);
    if (b.id != static_cast<int64_t>(i))
      buffers[i].at("id").bad("must be " + std::to_string(i) + " (buffers are listed by id)");
    std::optional<int64_t> end = checkedAdd(b.offset, b.bytes);
    if (!end || *end > r.arenaBytes)
      buffers[i].at("offset").bad("places " + std::to_string(b.bytes) + " bytes at " +
                                  std::to_string(b.offset) + ", past the arena of " +
                                  std::to_string(r.arenaBytes) + " bytes");
    if (int64_t size = int64_t(dtypeSize(b.dtype)); b.offset % size != 0)
      buffers[i].at("offset").bad("is " + std::to_string(b.offset) + ", not a multiple of " +
                                  std::to_string(size) + " (the size of " + dtypeName(b.dtype) +
                                  "): the buffer would be misaligned");
    if (b.viewOf >= 0) {
      if (b.viewOf >= static_cast<int64_t>(i))
        buffers[i].at("view_of").bad("must name an earlier buffer");
      const Buffer &root = r.buffers[b.viewOf];
      // A reshape (the viewed buffer's storage and size), or a slice: a
      // contiguous part of it, `view_offset` bytes in.
      std::optional<int64_t> sliceEnd = checkedAdd(b.viewOffset, b.bytes);
      if (b.viewOffset < 0 || !sliceEnd || *sliceEnd > root.bytes || root.offset + b.viewOffset != b.offset)
        buffers[i].at(b.viewOffset != 0 ? "view_offset" : "view_of")
            .bad(b.viewOffset != 0 ? "must place the slice inside the viewed buffer, at its offset plus " +
                                         std::to_string(b.viewOffset)
                                   : std::string("must share the viewed buffer's storage and fit in it"));
    } else if (b.viewOffset != 0) {
      buffers[i].at("view_offset").bad("is only for a view (a buffer with view_of)");
    }
    r.buffers.push_back(b);
  }
  checkPersistentOverlap(r, buffers);
  auto bufferRef = [&](const Field &fld) {
    int64_t id = fld.integer(0);
    if (id >= static_cast<int64_t>(r.buffers.size()))
      fld.bad("names buffer " + std::to_string(id) + " but there are " +
              std::to_string(r.buffers.size()));
    return id;
  };
  auto named = [&](const char *key, std::vector<NamedBuffer> &out) {
    Field list = f.at(key);
    std::set<std::string> seen;
    for (size_t i = 0; i < list.size(); ++i) {
      NamedBuffer nb{list[i].at("name").string(), bufferRef(list[i].at("buffer"))};
      if (list[i].has("limit"))
        nb.limit = list[i].at("limit").integer(0);
      if (!seen.insert(nb.name).second)
        list[i].at("name").bad("repeats '" + nb.name + "'");
      out.push_back(nb);
    }
  };
  named("inputs", r.inputs);
  named("outputs", r.outputs);
  if (f.has("state")) {
    named("state", r.state);
    for (const NamedBuffer &nb : r.state)
      if (r.buffers[nb.buffer].role != BufferRole::State)
        f.at("state").bad("names buffer " + std::to_string(nb.buffer) + ", whose role is not 'state'");
  }

  Field params = f.at("parameters");
  std::set<std::string> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    Parameter p;
    p.name = params[i].at("name").string();
    p.buffer = bufferRef(params[i].at("buffer"));
    if (r.buffers[p.buffer].role != BufferRole::Param)
      params[i].at("buffer").bad("must name a buffer with role 'param'");
    p.init.kind = params[i].at("init").at("kind").string();
    p.init.scale = params[i].at("init").at("scale").number();
    if (params[i].has("grad"))
      p.grad = bufferRef(params[i].at("grad"));
    if (params[i].has("shard")) {
      Field sh = params[i].at("shard");
      p.shard.fullShape = sh.at("full_shape").integers(0);
      if (sh.has("zero_parts")) {
        p.shard.zeroParts = sh.at("zero_parts").integer(2);
        p.shard.zeroIndex = sh.at("zero_index").integer(0);
        if (p.shard.zeroIndex >= p.shard.zeroParts)
          sh.at("zero_index").bad("must be below zero_parts (" + std::to_string(p.shard.zeroParts) + ")");
      }
      p.shard.axis = sh.at("axis").integer(p.shard.zeroParts > 1 ? -1 : 0);
      p.shard.parts = sh.at("parts").integer(1);
      p.shard.index = sh.at("index").integer(0);
      p.shard.blocks = sh.at("blocks").integer(1);
      const Shape &local = r.buffers[p.buffer].shape;
      const Shape &full = p.shard.fullShape;
      // The tensor-parallel part: the buffer itself, or what ZeRO-3 cuts.
      Shape tpPart = local;
      std::optional<int64_t> fullCount = numElements(full);
      if (p.shard.zeroParts > 1)
        tpPart = p.shard.axis >= 0 && p.shard.axis < int64_t(full.size()) ? p.shard.partShape() : full;
      bool ok = full.size() == tpPart.size() && p.shard.axis < int64_t(full.size()) &&
                p.shard.index < p.shard.parts;
      std::optional<int64_t> slices = checkedMul(p.shard.blocks, p.shard.parts);
      ok = ok && slices && fullCount;
      for (size_t d = 0; ok && d < full.size(); ++d)
        ok = int64_t(d) == p.shard.axis
                 ? full[d] % *slices == 0 && checkedMul(tpPart[d], p.shard.parts) == full[d]
                 : full[d] == tpPart[d];
      if (ok && p.shard.zeroParts > 1) { // one chunk of ceil(elements / zero_parts)
        std::optional<int64_t> m = numElements(tpPart);
        ok = m && local.size() == 1 && local[0] == (*m + p.shard.zeroParts - 1) / p.shard.zeroParts;
      }
      if (!ok)
        sh.bad("does not describe a part of " + shapeStr(full) + " shaped " + shapeStr(local));
    }
    if (!seen.insert(p.name).second)
      params[i].at("name").bad("repeats '" + p.name + "'");
    r.params.push_back(p);
  }

  Field programs = f.at("programs");
  if (!programs.raw().is_object())
    programs.bad("must be an object of instruction lists");
  for (auto &[name, _] : programs.raw().items()) {
    Field list = programs.at(name.c_str());
    std::vector<Instruction> &out = r.programs[name];
    for (size_t i = 0; i < list.size(); ++i) {
      Instruction ins;
      ins.op = list[i].at("op").string();
      for (size_t k = 0; k < list[i].at("in").size(); ++k)
        ins.in.push_back(bufferRef(list[i].at("in")[k]));
      for (size_t k = 0; k < list[i].at("out").size(); ++k)
        ins.out.push_back(bufferRef(list[i].at("out")[k]));
      if (list[i].has("attrs")) {
        if (!list[i].at("attrs").raw().is_object())
          list[i].at("attrs").bad("must be an object");
        ins.attrs = list[i].at("attrs").raw();
      }
      checkAgainstTable(list[i], ins);
      out.push_back(std::move(ins));
    }
  }
  if (f.has("groups")) {
    Field groups = f.at("groups");
    if (!groups.raw().is_object())
      groups.bad("must be an object of rank lists");
    for (auto &[name, _] : groups.raw().items()) {
      std::vector<int64_t> members = groups.at(name.c_str()).integers(0);
      if (std::find(members.begin(), members.end(), r.rank) == members.end())
        groups.at(name.c_str()).bad("does not contain the rank itself");
      r.groups[name] = members;
    }
  }
  if (f.has("coords")) {
    Field coords = f.at("coords");
    if (!coords.raw().is_object())
      coords.bad("must be an object");
    for (auto &[name, _] : coords.raw().items())
      r.coords[name] = coords.at(name.c_str()).integer(0);
  }
  return r;
}

/// The serving section: the cache's geometry and the step programs, each
/// with its inputs and output in rank 0 (every rank of a tensor-parallel
/// serving bundle binds the same names).
ServeConfig parseServe(const Field &f, const Manifest &m) {
  ServeConfig s;
  s.blockSize = f.at("block_size").integer(1);
  s.numBlocks = f.at("num_blocks").integer(1);
  s.maxBlocksPerSeq = f.at("max_blocks_per_seq").integer(1);
  s.maxSeq = f.at("max_seq").integer(1);
  s.maxBatch = f.at("max_batch").integer(1);
  s.vocab = f.at("vocab").integer(1);
  if (f.has("prepare"))
    s.prepare = f.at("prepare").string();
  std::optional<int64_t> span = checkedMul(s.blockSize, s.maxBlocksPerSeq);
  if (!span || *span < s.maxSeq)
    f.at("max_blocks_per_seq").bad("holds fewer than max_seq tokens in blocks of block_size");
  Field programs = f.at("programs");
  if (programs.size() == 0)
    programs.bad("must list at least one program");
  for (const RankProgram &r : m.ranks) {
    if (!s.prepare.empty() && !r.programs.count(s.prepare))
      f.at("prepare").bad("names program '" + s.prepare + "', which rank " + std::to_string(r.rank) +
                          " does not have");
  }
  for (size_t i = 0; i < programs.size(); ++i) {
    ServeProgram p{programs[i].at("name").string(), programs[i].at("tokens").integer(1),
                   programs[i].at("rows").integer(1)};
    if (p.rows > p.tokens)
      programs[i].at("rows").bad("must not exceed tokens");
    if (!s.programs.empty() && p.tokens <= s.programs.back().tokens)
      programs[i].at("tokens").bad("must grow from one program to the next");
    for (const RankProgram &r : m.ranks) {
      if (!r.programs.count(p.name))
        programs[i].at("name").bad("names program '" + p.name + "', which rank " + std::to_string(r.rank) +
                                   " does not have");
      auto check = [&](const std::vector<NamedBuffer> &list, const std::string &suffix, const Shape &shape,
                       bool integer) {
        std::string name = p.name + "." + suffix;
        auto it = std::find_if(list.begin(), list.end(), [&](const NamedBuffer &nb) { return nb.name == name; });
        if (it == list.end())
          programs[i].bad("needs rank " + std::to_string(r.rank) + " to bind '" + name + "'");
        const Buffer &b = r.buffers[it->buffer];
        bool typeOk = integer ? b.dtype == LOOM_I32 : (b.dtype == LOOM_F32 || b.dtype == LOOM_BF16);
        if (b.shape != shape || !typeOk)
          programs[i].bad("needs '" + name + "' shaped " + shapeStr(shape) + (integer ? " i32" : " f32 or bf16") +
                          ", rank " + std::to_string(r.rank) + " has " + shapeStr(b.shape) + " " +
                          dtypeName(b.dtype));
      };
      check(r.inputs, "tokens", {1, p.tokens}, true);
      check(r.inputs, "positions", {1, p.tokens}, true);
      check(r.inputs, "slots", {p.tokens}, true);
      check(r.inputs, "block_table", {p.tokens, s.maxBlocksPerSeq}, true);
      check(r.inputs, "rows", {p.rows}, true);
      check(r.outputs, "logits", {1, p.rows, s.vocab}, false);
    }
    s.programs.push_back(p);
  }
  return s;
}

} // namespace

ServeConfig parseServeConfig(const json &doc, const Manifest &m, const std::string &where) {
  return parseServe(Field(doc, "serve", where), m);
}

json toJson(const ServeConfig &s) {
  json programs = json::array();
  for (const ServeProgram &p : s.programs)
    programs.push_back({{"name", p.name}, {"tokens", p.tokens}, {"rows", p.rows}});
  json doc = {{"block_size", s.blockSize}, {"num_blocks", s.numBlocks},
              {"max_blocks_per_seq", s.maxBlocksPerSeq}, {"max_seq", s.maxSeq},
              {"max_batch", s.maxBatch}, {"vocab", s.vocab}, {"programs", programs}};
  if (!s.prepare.empty())
    doc["prepare"] = s.prepare;
  return doc;
}

/// Calls copy(fullOffset, partOffset, bytes) for each contiguous piece of a
/// rank's part: rows before the axis, the axis as blocks x parts x piece.
template <typename Copy> static void forEachShardPiece(const ParamShard &s, size_t es, Copy copy) {
  int64_t outer = 1, inner = static_cast<int64_t>(es);
  for (int64_t d = 0; d < s.axis; ++d)
    outer *= s.fullShape[d];
  for (size_t d = s.axis + 1; d < s.fullShape.size(); ++d)
    inner *= s.fullShape[d];
  int64_t block = s.fullShape[s.axis] / s.blocks, piece = block / s.parts;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t b = 0; b < s.blocks; ++b)
      copy(((o * s.blocks + b) * block + s.index * piece) * inner, (o * s.blocks + b) * piece * inner,
           piece * inner);
}

Shape ParamShard::partShape() const {
  Shape shape = fullShape;
  if (axis >= 0 && axis < int64_t(shape.size()) && parts > 0)
    shape[size_t(axis)] /= parts;
  return shape;
}

void extractShard(const ParamShard &s, size_t es, const char *full, char *part) {
  if (s.zeroParts <= 1) {
    forEachShardPiece(s, es, [&](int64_t f, int64_t p, int64_t n) { std::memcpy(part + p, full + f, n); });
    return;
  }
  // The tensor-parallel part first, then its ZeRO-3 chunk (zeros past its end).
  int64_t m = numElements(s.partShape()).value_or(0), k = (m + s.zeroParts - 1) / s.zeroParts;
  std::vector<char> tpPart;
  const char *from = full;
  if (s.axis >= 0) {
    tpPart.resize(size_t(m) * es);
    forEachShardPiece(s, es, [&](int64_t f, int64_t p, int64_t n) { std::memcpy(tpPart.data() + p, full + f, n); });
    from = tpPart.data();
  }
  int64_t begin = std::min(m, s.zeroIndex * k), end = std::min(m, begin + k);
  std::memset(part, 0, size_t(k) * es);
  std::memcpy(part, from + begin * int64_t(es), size_t(end - begin) * es);
}

void insertShard(const ParamShard &s, size_t es, const char *part, char *full) {
  if (s.zeroParts <= 1) {
    forEachShardPiece(s, es, [&](int64_t f, int64_t p, int64_t n) { std::memcpy(full + f, part + p, n); });
    return;
  }
  int64_t m = numElements(s.partShape()).value_or(0), k = (m + s.zeroParts - 1) / s.zeroParts;
  int64_t begin = std::min(m, s.zeroIndex * k), end = std::min(m, begin + k);
  if (s.axis < 0) {
    std::memcpy(full + begin * int64_t(es), part, size_t(end - begin) * es);
    return;
  }
  std::vector<char> tpPart(size_t(m) * es);
  forEachShardPiece(s, es, [&](int64_t f, int64_t p, int64_t n) { std::memcpy(tpPart.data() + p, full + f, n); });
  std::memcpy(tpPart.data() + begin * int64_t(es), part, size_t(end - begin) * es);
  forEachShardPiece(s, es, [&](int64_t f, int64_t p, int64_t n) { std::memcpy(full + f, tpPart.data() + p, n); });
}

Manifest parseManifest(const json &doc, const std::string &where) {
  Field root(doc, "", where);
  if (!doc.is_object())
    root.bad("must be a JSON object");
  std::string format = root.at("format").string();
  if (format != kBundleFormat)
    root.at("format").bad("is '" + format + "', not '" + kBundleFormat +
                          "': this is not a Loom bundle");
  Manifest m;
  m.version = static_cast<int>(root.at("version").integer(1));
  if (m.version > kBundleVersion)
    fail(LOOM_UNSUPPORTED, where, ": bundle format version ", m.version,
         " is newer than this runtime understands (", kBundleVersion,
         "); rebuild the runtime from the same Loom as the compiler");
  m.model = root.at("model").string();
  m.mode = root.at("mode").string();
  m.batch = root.at("batch").integer(1);
  m.weights = root.at("weights").string();
  if (root.has("seed"))
    m.seed = static_cast<uint64_t>(root.at("seed").integer(0));
  if (root.has("kernels")) {
    m.kernels = root.at("kernels").string();
    if (m.kernels.find('/') != std::string::npos || m.kernels.find("..") != std::string::npos)
      root.at("kernels").bad("must be a file name inside the bundle");
  }
  if (root.has("tokenizer")) {
    m.tokenizer = root.at("tokenizer").string();
    if (m.tokenizer.empty() || m.tokenizer.find('/') != std::string::npos ||
        m.tokenizer.find("..") != std::string::npos)
      root.at("tokenizer").bad("must be a file name inside the bundle");
  }
  if (root.has("plan")) {
    if (!root.at("plan").raw().is_object())
      root.at("plan").bad("must be an object");
    m.plan = root.at("plan").raw();
  }
  if (m.weights.find('/') != std::string::npos || m.weights.find("..") != std::string::npos)
    root.at("weights").bad("must be a file name inside the bundle");
  Field ranks = root.at("ranks");
  if (ranks.size() == 0)
    ranks.bad("must list at least one rank");
  for (size_t i = 0; i < ranks.size(); ++i)
    m.ranks.push_back(parseRank(ranks[i], i));
  if (root.has("serve"))
    m.serve = parseServe(root.at("serve"), m);
  if (m.mode == "serve" && !m.serve.enabled())
    root.at("mode").bad("is 'serve' but the manifest has no 'serve' section");
  return m;
}

Communicators communicatorsOf(const Manifest &m) {
  // The instructions that communicate over a group: the collectives, whose
  // "group" defaults to the runtime's ("dp", or "tp" for an all_gather along
  // an axis: both count), and the norm and loss of a split model, which
  // reduce over theirs only when they name one.
  static const std::set<std::string> defaulted = {"all_reduce", "reduce_scatter", "all_gather", "broadcast_from"};
  static const std::set<std::string> naming = {"all_reduce", "reduce_scatter", "all_gather", "broadcast_from",
                                               "global_norm", "cross_entropy", "cross_entropy_grad"};
  Communicators c;
  for (const RankProgram &r : m.ranks) {
    std::set<std::string> named;
    for (const auto &[program, list] : r.programs)
      for (const Instruction &ins : list) {
        if (!ins.attrs.is_object())
          continue;
        if (ins.op == "send")
          c.links.insert({int(r.rank), int(ins.attrs.value("peer", int64_t(-1)))});
        if (!naming.count(ins.op))
          continue;
        for (const char *key : {"group", "vocab_group"})
          if (auto it = ins.attrs.find(key); it != ins.attrs.end() && it->is_string())
            named.insert(it->get<std::string>());
        if (defaulted.count(ins.op) && !ins.attrs.contains("group"))
          named.insert({"dp", "tp"});
      }
    for (const std::string &name : named)
      if (auto g = r.groups.find(name); g != r.groups.end() && g->second.size() > 1)
        c.groups.insert(std::vector<int>(g->second.begin(), g->second.end()));
  }
  return c;
}

int64_t Communicators::joinedBy(int rank) const {
  int64_t n = 0;
  for (const std::vector<int> &g : groups)
    n += std::count(g.begin(), g.end(), rank) > 0;
  for (const auto &[from, to] : links)
    n += from == rank || to == rank;
  return n;
}

Manifest readManifest(const std::string &bundleDir) {
  std::string path = bundleDir + "/manifest.json";
  std::ifstream in(path);
  if (!in) {
    struct stat st;
    if (::stat(bundleDir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      fail(LOOM_IO_ERROR, "'", bundleDir, "' is not a bundle directory (write one with loomc compile)");
    fail(LOOM_INVALID_BUNDLE, "cannot open '", path, "': ", std::strerror(errno));
  }
  json doc = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded())
    fail(LOOM_INVALID_BUNDLE, path, ": not valid JSON (truncated or corrupt manifest)");
  Manifest m = parseManifest(doc, path);
  if (!m.tokenizer.empty()) {
    struct stat st;
    std::string file = bundleDir + "/" + m.tokenizer;
    if (::stat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
      fail(LOOM_INVALID_BUNDLE, path, ": field 'tokenizer' names '", m.tokenizer,
           "', which is not a file in the bundle");
  }
  return m;
}

json toJson(const Manifest &m) {
  json ranks = json::array();
  for (const RankProgram &r : m.ranks) {
    json buffers = json::array();
    for (const Buffer &b : r.buffers) {
      json jb = {{"id", b.id},         {"name", b.name},     {"dtype", dtypeName(b.dtype)},
                 {"shape", b.shape},   {"offset", b.offset}, {"bytes", b.bytes},
                 {"role", roleName(b.role)}};
      if (b.viewOf >= 0)
        jb["view_of"] = b.viewOf;
      if (b.viewOffset != 0)
        jb["view_offset"] = b.viewOffset;
      buffers.push_back(jb);
    }
    auto named = [](const std::vector<NamedBuffer> &list) {
      json out = json::array();
      for (const NamedBuffer &nb : list) {
        json j = {{"name", nb.name}, {"buffer", nb.buffer}};
        if (nb.limit > 0)
          j["limit"] = nb.limit;
        out.push_back(j);
      }
      return out;
    };
    json params = json::array();
    for (const Parameter &p : r.params) {
      json jp = {{"name", p.name},
                 {"buffer", p.buffer},
                 {"init", {{"kind", p.init.kind}, {"scale", p.init.scale}}}};
      if (p.grad >= 0)
        jp["grad"] = p.grad;
      if (p.shard.split())
        jp["shard"] = {{"full_shape", p.shard.fullShape}, {"axis", p.shard.axis},
                       {"parts", p.shard.parts},          {"index", p.shard.index},
                       {"blocks", p.shard.blocks}};
      if (p.shard.zeroParts > 1)
        jp["shard"]["zero_parts"] = p.shard.zeroParts, jp["shard"]["zero_index"] = p.shard.zeroIndex;
      params.push_back(jp);
    }
    json programs = json::object();
    for (const auto &[name, instrs] : r.programs) {
      json list = json::array();
      for (const Instruction &ins : instrs) {
        json ji = {{"op", ins.op}, {"in", ins.in}, {"out", ins.out}};
        if (!ins.attrs.empty())
          ji["attrs"] = ins.attrs;
        list.push_back(ji);
      }
      programs[name] = list;
    }
    json jr = {{"rank", r.rank},
                     {"device", r.device},
                     {"arena_bytes", r.arenaBytes},
                     {"peak_activation_bytes", r.peakActivationBytes},
                     {"buffers", buffers},
                     {"inputs", named(r.inputs)},
                     {"outputs", named(r.outputs)},
                     {"parameters", params},
                     {"state", named(r.state)},
                     {"programs", programs}};
    if (!r.groups.empty())
      jr["groups"] = r.groups;
    if (!r.coords.empty())
      jr["coords"] = r.coords;
    ranks.push_back(jr);
  }
  json doc = {{"format", kBundleFormat}, {"version", m.version}, {"model", m.model},
              {"mode", m.mode},          {"batch", m.batch},     {"weights", m.weights},
              {"seed", m.seed},          {"ranks", ranks}};
  if (!m.plan.empty())
    doc["plan"] = m.plan;
  if (!m.kernels.empty())
    doc["kernels"] = m.kernels;
  if (m.serve.enabled())
    doc["serve"] = toJson(m.serve);
  if (!m.tokenizer.empty())
    doc["tokenizer"] = m.tokenizer;
  return doc;
}

void writeManifest(const Manifest &m, const std::string &bundleDir) {
  if (::mkdir(bundleDir.c_str(), 0755) != 0 && errno != EEXIST)
    fail(LOOM_IO_ERROR, "cannot create bundle directory '", bundleDir, "': ", std::strerror(errno));
  std::string text = toJson(m).dump(1);
  writeFileAtomically(bundleDir + "/manifest.json", text.data(), text.size());
}

} // namespace loom::rt
