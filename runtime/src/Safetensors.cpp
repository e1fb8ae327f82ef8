//===- Safetensors.cpp - Read and write safetensors files -----------------===//

#include "loom/rt/Safetensors.h"
#include "loom/rt/Error.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
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

namespace {
/// Validates a header (JSON text of `headerLen` bytes) against `dataSize`
/// bytes of data after it; fills tensors and metadata.
void parseHeader(const char *text, uint64_t headerLen, uint64_t dataSize, const std::string &path,
                 std::map<std::string, SafetensorsEntry> &tensors,
                 std::map<std::string, std::string> &metadata) {
  json header = json::parse(text, text + headerLen, nullptr, false);
  if (header.is_discarded() || !header.is_object())
    fail(LOOM_INVALID_BUNDLE, path, ": header is not a JSON object");
  for (auto &[name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (entry.is_object())
        for (auto &[k, v] : entry.items())
          if (v.is_string())
            metadata[k] = v.get<std::string>();
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
    tensors[name] = SafetensorsEntry{*dtype, shape, static_cast<size_t>(begin), expected};
  }
}

uint64_t headerLength(const unsigned char *first8) {
  uint64_t headerLen = 0;
  for (int i = 7; i >= 0; --i)
    headerLen = (headerLen << 8) | first8[i];
  return headerLen;
}
} // namespace

SafetensorsFile parseSafetensors(std::vector<char> file, const std::string &path) {
  if (file.size() < 8)
    fail(LOOM_INVALID_BUNDLE, path, ": truncated safetensors file (", file.size(),
         " bytes, less than its 8-byte header length)");
  uint64_t headerLen = headerLength(reinterpret_cast<const unsigned char *>(file.data()));
  if (headerLen > file.size() - 8)
    fail(LOOM_INVALID_BUNDLE, path, ": header length ", headerLen, " exceeds the file size (",
         file.size(), " bytes); the file is truncated or not safetensors");
  SafetensorsFile out;
  size_t dataStart = 8 + headerLen, dataSize = file.size() - dataStart;
  parseHeader(file.data() + 8, headerLen, dataSize, path, out.tensors, out.metadata);
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

SafetensorsIndex readSafetensorsIndex(const std::string &path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in)
    fail(LOOM_IO_ERROR, "cannot open '", path, "': ", std::strerror(errno));
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    fail(LOOM_IO_ERROR, "cannot read '", path, "': not a regular file");
  uint64_t size = static_cast<uint64_t>(st.st_size);
  unsigned char first8[8];
  in.seekg(0);
  if (size < 8 || !in.read(reinterpret_cast<char *>(first8), 8))
    fail(LOOM_INVALID_BUNDLE, path, ": truncated safetensors file (", size,
         " bytes, less than its 8-byte header length)");
  uint64_t headerLen = headerLength(first8);
  // The format caps headers at 100 MB; a larger length is damage, not a header.
  if (headerLen > size - 8 || headerLen > (uint64_t(100) << 20))
    fail(LOOM_INVALID_BUNDLE, path, ": header length ", headerLen, " exceeds the file size (",
         size, " bytes) or 100 MB; the file is truncated or not safetensors");
  std::string text(static_cast<size_t>(headerLen), '\0');
  if (headerLen && !in.read(text.data(), static_cast<std::streamsize>(headerLen)))
    fail(LOOM_IO_ERROR, "cannot read '", path, "': ", std::strerror(errno));
  SafetensorsIndex index;
  index.path = path;
  index.dataStart = 8 + headerLen;
  parseHeader(text.data(), headerLen, size - index.dataStart, path, index.tensors, index.metadata);
  return index;
}

std::vector<char> readSafetensorsTensor(const SafetensorsIndex &index, const std::string &name) {
  auto it = index.tensors.find(name);
  if (it == index.tensors.end())
    fail(LOOM_INVALID_ARGUMENT, index.path, ": has no tensor '", name, "'");
  std::ifstream in(index.path, std::ios::binary);
  std::vector<char> bytes(it->second.bytes);
  in.seekg(static_cast<std::streamoff>(index.dataStart + it->second.offset));
  if (!in || (!bytes.empty() && !in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()))))
    fail(LOOM_IO_ERROR, "cannot read tensor '", name, "' from '", index.path, "'");
  return bytes;
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

namespace {
/// The header text for `specs` laid out in order, padded with spaces to at
/// least `minLength` and to a multiple of 8 with its length word.
std::string headerText(const std::vector<SafetensorsSpec> &specs,
                       const std::map<std::string, std::string> &metadata, size_t minLength) {
  json header = json::object();
  header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto &t : specs) {
    size_t bytes = static_cast<size_t>(numElements(t.shape).value_or(0)) * dtypeSize(t.dtype);
    header[t.name] = {{"dtype", safetensorsDtype(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  if (text.size() < minLength)
    text.append(minLength - text.size(), ' ');
  while ((8 + text.size()) % 8 != 0) // align the data as the format recommends
    text += ' ';
  return text;
}

bool writeHeader(FILE *f, const std::string &text) {
  unsigned char len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<unsigned char>((uint64_t(text.size()) >> (8 * i)) & 0xff);
  return std::fwrite(len, 1, 8, f) == 8 && std::fwrite(text.data(), 1, text.size(), f) == text.size();
}
} // namespace

void writeSafetensorsStreaming(const std::string &path, const std::vector<SafetensorsSpec> &specs,
                               const std::map<std::string, std::string> &metadata,
                               const std::function<void(size_t, std::vector<char> &)> &produce) {
  // The checksum is known only after the data: the header is written with
  // room for the longest one (20 digits), then rewritten in place.
  std::map<std::string, std::string> meta = metadata;
  meta["fnv1a64"] = std::string(20, '0');
  size_t reserved = headerText(specs, meta, 0).size();
  // A tensor that cannot be produced (a damaged source) ends the write: the
  // temporary file goes and its error, not the write's, is what is thrown.
  std::exception_ptr producing;
  try {
    writeAtomically(path, [&](FILE *f) {
      if (std::fseek(f, static_cast<long>(8 + reserved), SEEK_SET) != 0)
        return false;
      uint64_t h = kFnvOffset;
      std::vector<char> bytes;
      for (size_t i = 0; i < specs.size(); ++i) {
        bytes.clear();
        try {
          produce(i, bytes);
        } catch (...) {
          producing = std::current_exception();
          return false;
        }
        size_t expected =
            static_cast<size_t>(numElements(specs[i].shape).value_or(0)) * dtypeSize(specs[i].dtype);
        if (bytes.size() != expected) {
          producing = std::make_exception_ptr(
              Error(LOOM_INTERNAL, cat(path, ": tensor '", specs[i].name, "' has ", bytes.size(),
                                       " bytes, expected ", expected)));
          return false;
        }
        h = fnv1a64(bytes.data(), bytes.size(), h);
        if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size())
          return false;
      }
      meta["fnv1a64"] = std::to_string(h);
      std::string text = headerText(specs, meta, reserved);
      return text.size() == reserved && std::fseek(f, 0, SEEK_SET) == 0 && writeHeader(f, text);
    });
  } catch (...) {
    if (producing)
      std::rethrow_exception(producing);
    throw;
  }
}

void writeSafetensors(const std::string &path, const std::vector<SafetensorsTensorRef> &tensors,
                      const std::map<std::string, std::string> &metadata) {
  std::map<std::string, std::string> meta = metadata;
  // A checksum of the data, so a damaged file is refused, not loaded.
  uint64_t h = kFnvOffset;
  std::vector<SafetensorsSpec> specs;
  for (const auto &t : tensors) {
    h = fnv1a64(static_cast<const char *>(t.data), t.bytes, h);
    specs.push_back({t.name, t.dtype, t.shape});
  }
  meta["fnv1a64"] = std::to_string(h);
  std::string text = headerText(specs, meta, 0);
  writeAtomically(path, [&](FILE *f) {
    if (!writeHeader(f, text))
      return false;
    for (const auto &t : tensors)
      if (t.bytes && std::fwrite(t.data, 1, t.bytes, f) != t.bytes)
        return false;
    return true;
  });
}

} // namespace loom::rt
