//===- Safetensors.h - Read and write safetensors files ---------*- C++ -*-===//
//
// The format: an 8-byte little-endian header length, a JSON header mapping
// each tensor name to {dtype, shape, data_offsets}, then the raw data.
// Reading validates every field against the file's size; writing goes to a
// temporary file that is renamed into place, so a crash never leaves a
// half-written file under the final name.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_SAFETENSORS_H
#define LOOM_RUNTIME_SAFETENSORS_H

#include "loom/rt/Tensor.h"

#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace loom::rt {

struct SafetensorsEntry {
  loom_dtype_t dtype;
  Shape shape;
  size_t offset = 0; // into SafetensorsFile::data
  size_t bytes = 0;
};

struct SafetensorsFile {
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
  std::vector<char> data;

  const char *bytesOf(const std::string &name) const {
    return data.data() + tensors.at(name).offset;
  }
};

/// The bytes of a regular file; throws Error naming it where it cannot be read.
std::vector<char> readWholeFile(const std::string &path);

/// Reads and validates a whole file; throws Error naming the file and field.
SafetensorsFile readSafetensors(const std::string &path);
/// Validates the bytes of a whole file; `path` names it in errors.
SafetensorsFile parseSafetensors(std::vector<char> file, const std::string &path);

/// A file's header alone, for reading one tensor at a time (a checkpoint
/// larger than memory): entries' offsets count from `dataStart`.
struct SafetensorsIndex {
  std::string path;
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
  size_t dataStart = 0;
};

/// Reads and validates the header of `path`; throws Error naming the field.
SafetensorsIndex readSafetensorsIndex(const std::string &path);
/// The bytes of one tensor of an indexed file.
std::vector<char> readSafetensorsTensor(const SafetensorsIndex &index, const std::string &name);

struct SafetensorsTensorRef {
  std::string name;
  loom_dtype_t dtype;
  Shape shape;
  const void *data;
  size_t bytes;
};

/// FNV-1a over bytes, continuing from `h`.
uint64_t fnv1a64(const char *data, size_t bytes, uint64_t h);

/// Writes atomically (PATH.tmp-PID then rename), with an FNV-1a checksum of
/// the data in the metadata ("fnv1a64") that readSafetensors verifies.
void writeSafetensors(const std::string &path, const std::vector<SafetensorsTensorRef> &tensors,
                      const std::map<std::string, std::string> &metadata = {});

struct SafetensorsSpec {
  std::string name;
  loom_dtype_t dtype;
  Shape shape;
};

/// Writes tensors one at a time, in the order of `specs`: `produce(i, bytes)`
/// fills tensor i's bytes, which are written before the next is asked for.
/// The file is written as writeSafetensors does (atomically, with a checksum).
void writeSafetensorsStreaming(const std::string &path, const std::vector<SafetensorsSpec> &specs,
                               const std::map<std::string, std::string> &metadata,
                               const std::function<void(size_t, std::vector<char> &)> &produce);

/// Writes `bytes` to `path` through a temporary file and a rename.
void writeFileAtomically(const std::string &path, const void *data, size_t bytes);

/// Calls `write` on a temporary file beside `path`, syncs it and renames it
/// into place; removes it and throws if `write` returns false. First removes
/// what interrupted writes to `path` left (removeStaleTemporaries).
void writeAtomically(const std::string &path, const std::function<bool(FILE *)> &write);

/// The temporary beside `path` this process writes: PATH.tmp-PID.
std::string temporaryPath(const std::string &path);

/// Removes PATH.tmp-PID files and directories (and PATH.tmp-PID.* ones) left
/// by processes that are no longer running: a killed save or compile.
void removeStaleTemporaries(const std::string &path);

} // namespace loom::rt

#endif
