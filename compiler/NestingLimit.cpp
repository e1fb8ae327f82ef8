//===- NestingLimit.cpp - Refuse text nested too deep to parse ------------===//

#include "compiler/NestingLimit.h"

#include "llvm/ADT/Twine.h"
#include "llvm/Support/WithColor.h"

using namespace mlir;

LogicalResult mlir::loom::checkNesting(const llvm::SourceMgr &sourceMgr, unsigned bufferId) {
  llvm::StringRef text = sourceMgr.getMemoryBuffer(bufferId)->getBuffer();
  int depth = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c == '"') { // a string literal, up to its unescaped closing quote
      for (++i; i < text.size() && text[i] != '"'; ++i)
        if (text[i] == '\\')
          ++i;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      i = text.find('\n', i);
      if (i == llvm::StringRef::npos)
        break;
    } else if (c == '(' || c == '[' || c == '{' || c == '<') {
      if (++depth > kMaxNesting) {
        // FILE:LINE:COL without the source line, which may be megabytes of brackets.
        auto [line, column] =
            sourceMgr.getLineAndColumn(llvm::SMLoc::getFromPointer(text.data() + i), bufferId);
        llvm::WithColor::error(llvm::errs(),
                               (sourceMgr.getMemoryBuffer(bufferId)->getBufferIdentifier() + ":" +
                                llvm::Twine(line) + ":" + llvm::Twine(column))
                                   .str())
            << "nesting deeper than " << kMaxNesting
            << " levels of (), [], {} and <> (the parser would run out of stack)\n";
        return failure();
      }
    } else if (c == ')' || c == ']' || c == '}' || (c == '>' && (i == 0 || text[i - 1] != '-'))) {
      // Unbalanced closers are the parser's to report; they never count below 0.
      depth = depth > 0 ? depth - 1 : 0;
    }
  }
  return success();
}
