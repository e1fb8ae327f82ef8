//===- Safetensors.cpp - Read and write safetensors files -----------------===//

#include "loom/rt/Safetensors.h"
#include "loom/rt/Error.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::rt {

using json = nlohmann::json;

constexpr uint64_t kFnvOffset = 1469598103934665603ull;

std::vector<char> readWholeFile(const std::string &path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in)
    fail(LOOM_IO_ERROR, "cannot open '", path, "': ", std::strerror(errno));
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    fail(LOOM_IO_ERROR, "cannot read '", path, "': not a regular file");
  std::streamsize size = in.tellg();
  if (size < 0)
    fail(LOOM_IO_ERROR, "cannot read '", path, "'");
  std::vector<char> data(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(data.data(), size))
    fail(LOOM_IO_ERROR, "cannot read '", path, "': ", std::strerror(errno));
  return data;
}

SafetensorsFile readSafetensors(const std::string &path) {
  return parseSafetensors(readWholeFile(path), path);
}

SafetensorsFile parseSafetensors(std::vector<char> file, const std::string &path) {
  if (file.size() < 8)
    fail(LOOM_INVALID_BUNDLE, path, ": truncated safetensors file (", file.size(),
         " bytes, less than its 8-byte header length)");
  uint64_t headerLen = 0;
  for (int i = 7; i >= 0; --i)
    headerLen = (headerLen << 8) | static_cast<unsigned char>(file[i]);
  if (headerLen > file.size() - 8)
    fail(LOOM_INVALID_BUNDLE, path, ": header length ", headerLen, " exceeds the file size (",
         file.size(), " bytes); the file is truncated or not safetensors");
  json header = json::parse(file.begin() + 8, file.begin() + 8 + headerLen, nullptr, false);
  if (header.is_discarded() || !header.is_object())
    fail(LOOM_INVALID_BUNDLE, path, ": header is not a JSON object");

  SafetensorsFile out;
  size_t dataStart = 8 + headerLen, dataSize = file.size() - dataStart;
  for (auto &[name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (entry.is_object())
        for (auto &[k, v] : entry.items())
          if (v.is_string())
            out.metadata[k] = v.get<std::string>();
      continue;
    }
    auto where = [&](const char *field) { return cat(path, ": tensor '", name, "' field '", field, "'"); };
    if (!entry.is_object())
      fail(LOOM_INVALID_BUNDLE, path, ": tensor '", name, "' is not an object");
    auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string())
      fail(LOOM_INVALID_BUNDLE, where("dtype"), " is missing");
    std::optional<loom_dtype_t> dtype = parseSafetensorsDtype(dt->get<std::string>());
    if (!dtype)
      fail(LOOM_UNSUPPORTED, where("dtype"), ": unsupported dtype '", dt->get<std::string>(), "'");
    auto sh = entry.find("shape");
    if (sh == entry.end() || !sh->is_array())
      fail(LOOM_INVALID_BUNDLE, where("shape"), " is missing or not a list");
    Shape shape;
    for (auto &d : *sh) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        fail(LOOM_INVALID_BUNDLE, where("shape"), " has a negative or non-integer extent");
      shape.push_back(d.get<int64_t>());
    }
    auto offs = entry.find("data_offsets");
    if (offs == entry.end() || !offs->is_array() || offs->size() != 2 ||
        !(*offs)[0].is_number_unsigned() || !(*offs)[1].is_number_unsigned())
      fail(LOOM_INVALID_BUNDLE, where("data_offsets"), " must be two non-negative integers");
    uint64_t begin = (*offs)[0].get<uint64_t>(), end = (*offs)[1].get<uint64_t>();
    std::optional<int64_t> count = numElements(shape);
    if (!count)
      fail(LOOM_INVALID_BUNDLE, where("shape"), " is too large");
    uint64_t expected = uint64_t(*count) * dtypeSize(*dtype);
    if (begin > end || end > dataSize)
      fail(LOOM_INVALID_BUNDLE, where("data_offsets"), " [", begin, ", ", end,
           ") lies outside the data (", dataSize, " bytes); the file is truncated");
    if (end - begin != expected)
      fail(LOOM_INVALID_BUNDLE, where("data_offsets"), " covers ", end - begin, " bytes but ",
           dtypeName(*dtype), shapeStr(shape), " needs ", expected);
    out.tensors[name] = SafetensorsEntry{*dtype, shape, static_cast<size_t>(begin), expected};
  }
  out.data.assign(file.begin() + dataStart, file.end());
  if (auto it = out.metadata.find("fnv1a64"); it != out.metadata.end()) {
    // The data in the order the writer laid it out: by offset.
    std::vector<const SafetensorsEntry *> entries;
    for (auto &[name, e] : out.tensors)
      entries.push_back(&e);
    std::sort(entries.begin(), entries.end(),
              [](auto *a, auto *b) { return a->offset < b->offset; });
    uint64_t h = kFnvOffset;
    for (const SafetensorsEntry *e : entries)
      h = fnv1a64(out.data.data() + e->offset, e->bytes, h);
    if (std::to_string(h) != it->second)
      fail(LOOM_INVALID_BUNDLE, path, ": checksum mismatch: the data is damaged (the file was "
           "modified or only partly written); refusing to load it");
  }
  return out;
}

std::string temporaryPath(const std::string &path) {
  return path + ".tmp-" + std::to_string(::getpid());
}

void removeStaleTemporaries(const std::string &path) {
  namespace fs = std::filesystem;
  fs::path target(path);
  fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::string prefix = target.filename().string() + ".tmp-";
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0)
      continue;
    size_t digits = prefix.size();
    while (digits < name.size() && std::isdigit(static_cast<unsigned char>(name[digits])))
      ++digits;
    if (digits == prefix.size() || digits > prefix.size() + 9 ||
        (digits < name.size() && name[digits] != '.'))
      continue;
    pid_t pid = static_cast<pid_t>(std::stol(name.substr(prefix.size(), digits - prefix.size())));
    // A process that is alive (or not ours to signal) may still be writing it.
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH)
      continue;
    std::error_code ignored; // best effort: the next save tries again
    fs::remove_all(it->path(), ignored);
  }
}

void writeAtomically(const std::string &path, const std::function<bool(FILE *)> &write) {
  removeStaleTemporaries(path);
  std::string tmp = temporaryPath(path);
  FILE *f = std::fopen(tmp.c_str(), "wb");
  if (!f)
    fail(LOOM_IO_ERROR, "cannot create '", tmp, "': ", std::strerror(errno));
  bool ok = write(f);
  ok = (std::fflush(f) == 0) && ok;
  ok = (::fsync(::fileno(f)) == 0) && ok;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    int err = errno;
    std::remove(tmp.c_str());
    fail(LOOM_IO_ERROR, "cannot write '", tmp, "': ", std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp.c_str());
    fail(LOOM_IO_ERROR, "cannot rename '", tmp, "' to '", path, "': ", std::strerror(err));
  }
}

void writeFileAtomically(const std::string &path, const void *data, size_t bytes) {
  writeAtomically(path, [&](FILE *f) { return bytes == 0 || std::fwrite(data, 1, bytes, f) == bytes; });
}

uint64_t fnv1a64(const char *data, size_t bytes, uint64_t h) {
  for (size_t i = 0; i < bytes; ++i)
    h = (h ^ static_cast<unsigned char>(data[i])) * 1099511628211ull;
  return h;
}

void writeSafetensors(const std::string &path, const std::vector<SafetensorsTensorRef> &tensors,
                      const std::map<std::string, std::string> &metadata) {
  json header = json::object();
  std::map<std::string, std::string> meta = metadata;
  // A checksum of the data, so a damaged file is refused, not loaded.
  uint64_t h = kFnvOffset;
  for (const auto &t : tensors)
    h = fnv1a64(static_cast<const char *>(t.data), t.bytes, h);
  meta["fnv1a64"] = std::to_string(h);
  header["__metadata__"] = meta;
  std::vector<size_t> order; // data in the order given, header keys sorted by json
  size_t offset = 0;
  for (const auto &t : tensors) {
    header[t.name] = {{"dtype", safetensorsDtype(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) // align the data as the format recommends
    text += ' ';
  writeAtomically(path, [&](FILE *f) {
    unsigned char len[8];
    for (int i = 0; i < 8; ++i)
      len[i] = static_cast<unsigned char>((uint64_t(text.size()) >> (8 * i)) & 0xff);
    if (std::fwrite(len, 1, 8, f) != 8 || std::fwrite(text.data(), 1, text.size(), f) != text.size())
      return false;
    for (const auto &t : tensors)
      if (t.bytes && std::fwrite(t.data, 1, t.bytes, f) != t.bytes)
        return false;
    return true;
  });
}

} // namespace loom::rt
