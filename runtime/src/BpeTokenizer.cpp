//===- BpeTokenizer.cpp - GPT-2 byte-level BPE from tokenizer.json --------===//
//
// As the tokenizers library runs a ByteLevel pre-tokenizer and a BPE model:
// added tokens are cut out of the text first; the rest is split by GPT-2's
// pattern ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
// \s+(?!\S)|\s+), each piece's bytes are mapped to printable characters
// (bytes_to_unicode), and merges are applied lowest rank first.
//
//===----------------------------------------------------------------------===//

#include "runtime/src/TokenizerImpl.h"
#include "loom/rt/Error.h"
#include "loom/rt/Safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iterator>
#include <cstdio>
#include <limits>
#include <unordered_map>

namespace loom::rt {

namespace {

using json = nlohmann::json;

struct CodePointRange {
  char32_t first, last;
};
#include "runtime/src/UnicodeTables.inc"

template <size_t N> bool inRanges(const CodePointRange (&ranges)[N], char32_t cp) {
  auto it = std::upper_bound(std::begin(ranges), std::end(ranges), cp,
                             [](char32_t c, const CodePointRange &r) { return c < r.first; });
  return it != std::begin(ranges) && cp <= std::prev(it)->last;
}

bool isLetter(char32_t cp) { return inRanges(kLetterRanges, cp); }
bool isNumber(char32_t cp) { return inRanges(kNumberRanges, cp); }
bool isSpace(char32_t cp) { // Unicode's White_Space
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

/// A text as code points, each with its byte range. Bytes that are not
/// UTF-8 stand alone (as U+FFFD would: neither letter, number nor space).
struct CodePoints {
  std::vector<char32_t> cps;
  std::vector<size_t> starts; // cps.size() + 1 entries

  explicit CodePoints(std::string_view s) {
    size_t i = 0;
    while (i < s.size()) {
      unsigned char c = static_cast<unsigned char>(s[i]);
      size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
      char32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
      bool ok = len > 0 && i + len <= s.size();
      for (size_t k = 1; ok && k < len; ++k) {
        unsigned char cc = static_cast<unsigned char>(s[i + k]);
        ok = (cc & 0xC0) == 0x80;
        cp = (cp << 6) | (cc & 0x3F);
      }
      if (!ok) {
        len = 1;
        cp = 0xFFFD;
      }
      starts.push_back(i);
      cps.push_back(cp);
      i += len;
    }
    starts.push_back(s.size());
  }
};

/// GPT-2's pre-tokenizer pattern over `text`: the byte ranges of its pieces.
std::vector<std::string_view> splitPieces(std::string_view text) {
  CodePoints t(text);
  const std::vector<char32_t> &c = t.cps;
  size_t n = c.size();
  std::vector<std::string_view> pieces;
  auto other = [&](size_t k) { return !isSpace(c[k]) && !isLetter(c[k]) && !isNumber(c[k]); };
  size_t i = 0;
  while (i < n) {
    size_t end = i;
    // 's 't 're 've 'm 'll 'd
    if (c[i] == '\'' && i + 1 < n) {
      char32_t a = c[i + 1], b = i + 2 < n ? c[i + 2] : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd')
        end = i + 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        end = i + 3;
    }
    if (end == i) {
      size_t j = c[i] == ' ' ? i + 1 : i; // the optional leading space
      if (j < n && isLetter(c[j])) {
        for (end = j; end < n && isLetter(c[end]); ++end) {}
      } else if (j < n && isNumber(c[j])) {
        for (end = j; end < n && isNumber(c[end]); ++end) {}
      } else if (j < n && other(j)) {
        for (end = j; end < n && other(end); ++end) {}
      } else {
        // \s+(?!\S): a run of spaces, less its last if a non-space follows;
        // \s+ then takes a lone space before a non-space.
        size_t k = i;
        while (k < n && isSpace(c[k]))
          ++k;
        end = (k < n && k - i > 1) ? k - 1 : k;
      }
    }
    pieces.push_back(text.substr(t.starts[i], t.starts[end] - t.starts[i]));
    i = end;
  }
  return pieces;
}

void appendUtf8(std::string &out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class BpeTokenizer final : public Tokenizer {
public:
  BpeTokenizer(const std::vector<char> &bytes, const std::string &path);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t> &ids) const override {
    std::string out;
    for (int32_t id : ids)
      out += tokenBytes(id, false);
    return out;
  }
  int32_t vocabSize() const override { return static_cast<int32_t>(idToToken.size()); }
  std::optional<int32_t> tokenId(std::string_view token) const override {
    auto it = tokenToId.find(std::string(token));
    return it == tokenToId.end() ? std::nullopt : std::optional<int32_t>(it->second);
  }
  std::optional<int32_t> bosId() const override { return firstOf({"<|endoftext|>", "<s>"}); }
  std::optional<int32_t> eosId() const override { return firstOf({"<|endoftext|>", "</s>"}); }

protected:
  std::string tokenBytes(int32_t id, bool) const override {
    if (id < 0 || id >= vocabSize())
      return "";
    if (added[id])
      return idToToken[id];
    std::string out;
    for (char32_t cp : CodePoints(idToToken[id]).cps) {
      auto it = unicodeToByte.find(cp);
      if (it != unicodeToByte.end())
        out += static_cast<char>(it->second);
      else
        appendUtf8(out, cp);
    }
    return out;
  }

private:
  std::optional<int32_t> firstOf(std::initializer_list<const char *> names) const {
    for (const char *name : names)
      if (auto it = tokenToId.find(name); it != tokenToId.end() && added[it->second])
        return it->second;
    return std::nullopt;
  }
  void encodePiece(std::string_view piece, std::vector<int32_t> &ids) const;

  std::unordered_map<std::string, int32_t> tokenToId;
  std::vector<std::string> idToToken;
  std::vector<bool> added;                 // by id: an added token, matched literally
  std::vector<std::string> addedByLength;  // added tokens, longest first
  std::unordered_map<std::string, int32_t> mergeRank; // "a b" -> rank
  std::string byteToUnicode[256];
  std::unordered_map<char32_t, uint8_t> unicodeToByte;
  bool addPrefixSpace = false, ignoreMerges = false, byteFallback = false;
  std::optional<int32_t> unk;
};

/// tokenizer.json's fields, each error naming the file and the field.
struct JsonField {
  const json &value;
  std::string name;
  const std::string &path;

  [[noreturn]] void bad(const std::string &what) const {
    fail(LOOM_INVALID_ARGUMENT, path, ": field '", name, "' ", what);
  }
  JsonField at(const char *key) const {
    if (!value.is_object())
      bad("must be an object");
    std::string child = name.empty() ? key : name + "." + key;
    auto it = value.find(key);
    if (it == value.end())
      JsonField{value, child, path}.bad("is missing");
    return {*it, child, path};
  }
  bool has(const char *key) const {
    return value.is_object() && value.contains(key) && !value.at(key).is_null();
  }
  bool flag(const char *key, bool fallback) const {
    if (!has(key))
      return fallback;
    JsonField f = at(key);
    if (!f.value.is_boolean())
      f.bad("must be true or false");
    return f.value.get<bool>();
  }
  std::string string() const {
    if (!value.is_string())
      bad("must be a string");
    return value.get<std::string>();
  }
  int32_t id() const {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
        value.get<int64_t>() >= (int64_t(1) << 21))
      bad("must be a token id from 0 to 2^21, got " + value.dump());
    return static_cast<int32_t>(value.get<int64_t>());
  }
};

BpeTokenizer::BpeTokenizer(const std::vector<char> &bytes, const std::string &path) {
  json doc = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object())
    fail(LOOM_INVALID_ARGUMENT, path, ": not a JSON object (a tokenizers tokenizer.json)");
  JsonField root{doc, "", path};
  JsonField model = root.at("model");
  if (model.has("type") && model.at("type").string() != "BPE")
    model.at("type").bad("is '" + model.at("type").string() + "': Loom reads BPE tokenizer.json "
                         "files (SentencePiece models as tokenizer.model)");
  if (root.has("normalizer"))
    root.at("normalizer").bad("is set: Loom's byte-level BPE applies no normalizer (GPT-2 has none)");
  JsonField pre = root.at("pre_tokenizer");
  if (pre.at("type").string() != "ByteLevel")
    pre.at("type").bad("is '" + pre.at("type").string() + "': Loom reads GPT-2's ByteLevel "
                       "pre-tokenizer");
  if (!pre.flag("use_regex", true))
    pre.at("use_regex").bad("is false: Loom splits with GPT-2's pattern");
  addPrefixSpace = pre.flag("add_prefix_space", false);
  for (const char *affix : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.has(affix) && !model.at(affix).string().empty())
      model.at(affix).bad("is set: byte-level BPE has no subword affixes");
  ignoreMerges = model.flag("ignore_merges", false);
  byteFallback = model.flag("byte_fallback", false);

  JsonField vocab = model.at("vocab");
  if (!vocab.value.is_object() || vocab.value.empty())
    vocab.bad("must be a non-empty object of token -> id");
  int32_t maxId = -1;
  for (auto &[token, id] : vocab.value.items())
    maxId = std::max(maxId, JsonField{id, "model.vocab." + token, path}.id());
  std::vector<std::pair<std::string, int32_t>> addedTokens;
  if (root.has("added_tokens")) {
    JsonField list = root.at("added_tokens");
    if (!list.value.is_array())
      list.bad("must be a list");
    for (size_t i = 0; i < list.value.size(); ++i) {
      JsonField t{list.value[i], "added_tokens[" + std::to_string(i) + "]", path};
      std::string content = t.at("content").string();
      if (content.empty())
        t.at("content").bad("is empty");
      addedTokens.push_back({content, t.at("id").id()});
      maxId = std::max(maxId, addedTokens.back().second);
    }
  }
  idToToken.assign(maxId + 1, "");
  added.assign(maxId + 1, false);
  for (auto &[token, id] : vocab.value.items()) {
    tokenToId[token] = id.get<int32_t>();
    idToToken[id.get<int32_t>()] = token;
  }
  for (auto &[content, id] : addedTokens) {
    tokenToId[content] = id;
    idToToken[id] = content;
    added[id] = true;
    addedByLength.push_back(content);
  }
  std::sort(addedByLength.begin(), addedByLength.end(),
            [](const std::string &a, const std::string &b) { return a.size() > b.size(); });
  if (model.has("unk_token")) {
    std::string name = model.at("unk_token").string();
    if (auto it = tokenToId.find(name); it != tokenToId.end())
      unk = it->second;
  }

  // Merges: "a b" strings (tokenizers before 0.20) or ["a", "b"] pairs.
  JsonField merges = model.at("merges");
  if (!merges.value.is_array())
    merges.bad("must be a list");
  for (size_t i = 0; i < merges.value.size(); ++i) {
    const json &m = merges.value[i];
    std::string key;
    if (m.is_string() && m.get<std::string>().find(' ') != std::string::npos &&
        m.get<std::string>().find(' ') == m.get<std::string>().rfind(' '))
      key = m.get<std::string>();
    else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string())
      key = m[0].get<std::string>() + " " + m[1].get<std::string>();
    else
      JsonField{m, "model.merges[" + std::to_string(i) + "]", path}.bad(
          "must be \"a b\" or [\"a\", \"b\"], got " + m.dump());
    mergeRank.emplace(key, static_cast<int32_t>(i));
  }

  // GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves,
  // the others for 256, 257, ... in byte order.
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    char32_t cp = printable ? char32_t(b) : next++;
    appendUtf8(byteToUnicode[b], cp);
    unicodeToByte[cp] = static_cast<uint8_t>(b);
  }
}

void BpeTokenizer::encodePiece(std::string_view piece, std::vector<int32_t> &ids) const {
  std::vector<std::string> symbols;
  std::string word;
  for (char ch : piece) {
    symbols.push_back(byteToUnicode[static_cast<unsigned char>(ch)]);
    word += symbols.back();
  }
  if (ignoreMerges)
    if (auto it = tokenToId.find(word); it != tokenToId.end()) {
      ids.push_back(it->second);
      return;
    }
  // Merge the lowest-ranked adjacent pair (leftmost on ties) until none is left.
  while (symbols.size() > 1) {
    int32_t best = std::numeric_limits<int32_t>::max();
    size_t at = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = mergeRank.find(symbols[i] + " " + symbols[i + 1]);
      if (it != mergeRank.end() && it->second < best)
        best = it->second, at = i;
    }
    if (best == std::numeric_limits<int32_t>::max())
      break;
    symbols[at] += symbols[at + 1];
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  for (const std::string &s : symbols) {
    if (auto it = tokenToId.find(s); it != tokenToId.end()) {
      ids.push_back(it->second);
    } else if (byteFallback) {
      for (char32_t cp : CodePoints(s).cps) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", unicodeToByte.count(cp) ? unicodeToByte.at(cp) : 0);
        if (auto b = tokenToId.find(name); b != tokenToId.end())
          ids.push_back(b->second);
      }
    } else if (unk) {
      ids.push_back(*unk);
    } // else: as the tokenizers library, a symbol with no id is dropped
  }
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  bool atStart = true;
  auto encodeSpan = [&](std::string_view span) {
    if (span.empty())
      return;
    std::string prefixed;
    if (addPrefixSpace && atStart && span.front() != ' ') {
      prefixed = " " + std::string(span);
      span = prefixed;
    }
    atStart = false;
    for (std::string_view piece : splitPieces(span))
      encodePiece(piece, ids);
  };
  // Added tokens are matched literally, leftmost and then longest first.
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const std::string *match = nullptr;
    for (const std::string &t : addedByLength)
      if (text.compare(i, t.size(), t) == 0) {
        match = &t;
        break;
      }
    if (!match) {
      ++i;
      continue;
    }
    encodeSpan(text.substr(start, i - start));
    ids.push_back(tokenToId.at(*match));
    atStart = false;
    i += match->size();
    start = i;
  }
  encodeSpan(text.substr(start));
  return ids;
}

} // namespace

std::unique_ptr<Tokenizer> parseBpeTokenizer(const std::vector<char> &bytes, const std::string &path) {
  return std::make_unique<BpeTokenizer>(bytes, path);
}

} // namespace loom::rt
