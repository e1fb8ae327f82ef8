//===- ModelZoo.cpp - Model files of each family and size -----------------===//
//
// Writes readable model files in the loom dialect. Each repeated block
// appears once; checked-in files under models/ are exactly what these
// writers produce (test/models checks that).
//
//===----------------------------------------------------------------------===//

#include "compiler/ModelZoo.h"
#include "dialects/loom/IR/LoomOps.h"

#include <cmath>
#include <sstream>
#include <vector>

using namespace mlir::loom;

namespace {

constexpr int64_t kDyn = -1;

/// Shortest decimal form of an initializer scale.
std::string number(double v) {
  std::ostringstream os;
  os.precision(6);
  os << v;
  std::string s = os.str();
  if (s.find_first_of(".e") == std::string::npos)
    s += ".0";
  return s;
}

class Writer {
public:
  explicit Writer(std::string dtype) : dtype(std::move(dtype)) {}

  std::string t(std::vector<int64_t> dims, const std::string &elem = "") const {
    std::string s = "tensor<";
    for (int64_t d : dims)
      s += (d == kDyn ? std::string("?") : std::to_string(d)) + "x";
    return s + (elem.empty() ? dtype : elem) + ">";
  }
  std::string ids(std::vector<int64_t> dims) const { return t(std::move(dims), "i32"); }

  void line(const std::string &text) { os << indent << text << "\n"; }
  void blank() { os << "\n"; }
  void open(const std::string &text) {
    line(text);
    indent += "  ";
  }
  void close() {
    indent.resize(indent.size() - 2);
    line("}");
  }

  void param(const std::string &name, const std::string &type, const std::string &init) {
    line("loom.param @" + name + " : " + type + " init <" + init + ">");
  }
  /// Reads a parameter into %<ssa>.
  void get(const std::string &ssa, const std::string &name, const std::string &type) {
    line("%" + ssa + " = loom.get @" + name + " : " + type);
  }
  void op(const std::string &result, const std::string &text) {
    line("%" + result + " = " + text);
  }

  std::string str() const { return os.str(); }
  /// Every model's @loss: its forward pass, then the cross-entropy of the
  /// logits against the labels; closes the module and returns the text.
  std::string lossAndEnd(const std::string &input, const std::string &inputType, const std::string &labels,
                         const std::string &labelsType, const std::string &logitsType) {
    blank();
    open("func.func @loss(%" + input + ": " + inputType + ", %" + labels + ": " + labelsType + ") -> tensor<f32> {");
    op("logits", "call @forward(%" + input + ") : (" + inputType + ") -> " + logitsType);
    op("loss", "loom.cross_entropy %logits, %" + labels + " : " + logitsType + ", " + labelsType);
    line("return %loss : tensor<f32>");
    close();
    close();
    return str();
  }

  std::string dtype;

private:
  std::ostringstream os;
  std::string indent;
};

std::string normal(double std) { return "normal(" + number(std) + ")"; }

/// A float attribute's value as MLIR parses it back to the same double.
std::string exactFloat(double v) {
  std::ostringstream os;
  for (int precision = 6; precision <= 17; ++precision) {
    os.str("");
    os.precision(precision);
    os << v;
    if (std::stod(os.str()) == v)
      break;
  }
  std::string s = os.str();
  if (s.find('.') == std::string::npos) { // MLIR's float literals need a point
    size_t e = s.find('e');
    s.insert(e == std::string::npos ? s.size() : e, ".0");
  }
  return s;
}

/// ", loom.tokenizer = ..." where the model names a tokenizer file.
std::string tokenizerAttr(const ModelConfig &c) {
  std::string escaped;
  for (char ch : c.tokenizer) {
    if (ch == '"' || ch == '\\')
      escaped += '\\';
    escaped += ch;
  }
  return c.tokenizer.empty() ? "" : ", loom.tokenizer = \"" + escaped + "\"";
}

/// " {eps = ...}" where the config sets an epsilon, else "".
std::string epsAttr(const ModelConfig &c) {
  return c.normEps > 0 ? " {eps = " + exactFloat(c.normEps) + " : f64}" : "";
}

//===----------------------------------------------------------------------===//
// GPT-2
//===----------------------------------------------------------------------===//

std::string writeGpt(const ModelConfig &c) {
  Writer w(c.dtype);
  int64_t h = c.hidden, s = c.seq, v = c.vocab, f = c.ffn;
  std::string X = w.t({kDyn, s, h}), H = w.t({h}), QKV = w.t({kDyn, s, 3 * h}),
              F = w.t({kDyn, s, f});
  double residualStd = 0.02 / std::sqrt(2.0 * c.layers);

  w.line("// GPT-2 style decoder: " + std::to_string(c.layers) + " layers, hidden " +
         std::to_string(h) + ", " + std::to_string(c.heads) + " heads, sequence " +
         std::to_string(s) + ", vocabulary " + std::to_string(v) + ", tied embeddings.");
  w.line(!c.origin.empty()
             ? c.origin
             : "// Written by: loomc models gpt --layers " + std::to_string(c.layers) +
                   " --hidden " + std::to_string(h) + " --heads " + std::to_string(c.heads) +
                   " --seq " + std::to_string(s) + " --vocab " + std::to_string(v) + " --ffn " +
                   std::to_string(f) + " --dtype " + c.dtype);
  w.open("module attributes {loom.family = \"gpt\"" + tokenizerAttr(c) + "} {");
  w.param("wte", w.t({v, h}), normal(0.02));
  w.param("wpe", w.t({s, h}), normal(0.01));
  w.param("ln_f.g", H, "ones");
  w.param("ln_f.b", H, "zeros");
  w.blank();
  w.line("// One pre-LayerNorm transformer layer; loom.repeat applies it per layer.");
  w.open("loom.block @layer(%x: " + X + ") -> " + X + " {");
  w.param("ln1.g", H, "ones");
  w.param("ln1.b", H, "zeros");
  w.param("attn.qkv.w", w.t({h, 3 * h}), normal(0.02));
  w.param("attn.qkv.b", w.t({3 * h}), "zeros");
  w.param("attn.proj.w", w.t({h, h}), normal(residualStd));
  w.param("attn.proj.b", H, "zeros");
  w.param("ln2.g", H, "ones");
  w.param("ln2.b", H, "zeros");
  w.param("mlp.fc.w", w.t({h, f}), normal(0.02));
  w.param("mlp.fc.b", w.t({f}), "zeros");
  w.param("mlp.proj.w", w.t({f, h}), normal(residualStd));
  w.param("mlp.proj.b", H, "zeros");
  w.blank();
  w.get("ln1_g", "ln1.g", H);
  w.get("ln1_b", "ln1.b", H);
  w.op("h1", "loom.layernorm %x, %ln1_g, %ln1_b" + epsAttr(c) + " : " + X + ", " + H + ", " + H);
  w.get("qkv_w", "attn.qkv.w", w.t({h, 3 * h}));
  w.get("qkv_b", "attn.qkv.b", w.t({3 * h}));
  w.op("qkv0", "loom.matmul %h1, %qkv_w : " + X + ", " + w.t({h, 3 * h}));
  w.op("qkv", "loom.add %qkv0, %qkv_b : " + QKV + ", " + w.t({3 * h}));
  w.op("q", "loom.slice %qkv {axis = 2, start = 0, size = " + std::to_string(h) + "} : " + QKV);
  w.op("k", "loom.slice %qkv {axis = 2, start = " + std::to_string(h) + ", size = " +
                std::to_string(h) + "} : " + QKV);
  w.op("v", "loom.slice %qkv {axis = 2, start = " + std::to_string(2 * h) + ", size = " +
                std::to_string(h) + "} : " + QKV);
  w.op("a", "loom.attention %q, %k, %v {causal, num_heads = " + std::to_string(c.heads) +
                "} : " + X + ", " + X + ", " + X);
  w.get("proj_w", "attn.proj.w", w.t({h, h}));
  w.get("proj_b", "attn.proj.b", H);
  w.op("o0", "loom.matmul %a, %proj_w : " + X + ", " + w.t({h, h}));
  w.op("o", "loom.add %o0, %proj_b : " + X + ", " + H);
  w.op("r1", "loom.add %x, %o : " + X + ", " + X);
  w.get("ln2_g", "ln2.g", H);
  w.get("ln2_b", "ln2.b", H);
  w.op("h2", "loom.layernorm %r1, %ln2_g, %ln2_b" + epsAttr(c) + " : " + X + ", " + H + ", " + H);
  w.get("fc_w", "mlp.fc.w", w.t({h, f}));
  w.get("fc_b", "mlp.fc.b", w.t({f}));
  w.op("u0", "loom.matmul %h2, %fc_w : " + X + ", " + w.t({h, f}));
  w.op("u1", "loom.add %u0, %fc_b : " + F + ", " + w.t({f}));
  w.op("u", "loom.gelu %u1 {approximate} : " + F);
  w.get("mproj_w", "mlp.proj.w", w.t({f, h}));
  w.get("mproj_b", "mlp.proj.b", H);
  w.op("d0", "loom.matmul %u, %mproj_w : " + F + ", " + w.t({f, h}));
  w.op("d", "loom.add %d0, %mproj_b : " + X + ", " + H);
  w.op("y", "loom.add %r1, %d : " + X + ", " + X);
  w.line("loom.yield %y : " + X);
  w.close();
  w.blank();
  std::string tokens = w.ids({kDyn, s}), logits = w.t({kDyn, s, v});
  w.open("func.func @forward(%tokens: " + tokens + ") -> " + logits + " {");
  w.get("wte", "wte", w.t({v, h}));
  w.get("wpe", "wpe", w.t({s, h}));
  w.op("tok", "loom.embedding %wte, %tokens : " + w.t({v, h}) + ", " + tokens);
  w.op("x0", "loom.add %tok, %wpe : " + X + ", " + w.t({s, h}));
  w.op("x", "loom.repeat " + std::to_string(c.layers) + " @layer(%x0) : (" + X + ") -> " + X);
  w.get("lnf_g", "ln_f.g", H);
  w.get("lnf_b", "ln_f.b", H);
  w.op("xf", "loom.layernorm %x, %lnf_g, %lnf_b" + epsAttr(c) + " : " + X + ", " + H + ", " + H);
  w.op("logits", "loom.matmul %xf, %wte {transpose_b} : " + X + ", " + w.t({v, h}));
  w.line("return %logits : " + logits);
  w.close();
  return w.lossAndEnd("tokens", tokens, "targets", tokens, logits);
}

//===----------------------------------------------------------------------===//
// Llama-style decoder
//===----------------------------------------------------------------------===//

std::string writeLlama(const ModelConfig &c) {
  Writer w(c.dtype);
  int64_t h = c.hidden, s = c.seq, v = c.vocab, f = c.ffn;
  int64_t headDim = h / c.heads, kv = c.kvHeads * headDim;
  std::string X = w.t({kDyn, s, h}), H = w.t({h}), KV = w.t({kDyn, s, kv}),
              F = w.t({kDyn, s, f});
  w.line("// Llama-style decoder: " + std::to_string(c.layers) + " layers, hidden " +
         std::to_string(h) + ", " + std::to_string(c.heads) + " heads (" +
         std::to_string(c.kvHeads) + " key/value heads), SwiGLU width " + std::to_string(f) +
         ", sequence " + std::to_string(s) + ", vocabulary " + std::to_string(v) + ".");
  w.line(!c.origin.empty()
             ? c.origin
             : "// Written by: loomc models llama --layers " + std::to_string(c.layers) +
                   " --hidden " + std::to_string(h) + " --heads " + std::to_string(c.heads) +
                   " --kv-heads " + std::to_string(c.kvHeads) + " --ffn " + std::to_string(f) +
                   " --seq " + std::to_string(s) + " --vocab " + std::to_string(v) +
                   " --dtype " + c.dtype);
  std::string rope = c.ropeTheta > 0 ? ", theta = " + exactFloat(c.ropeTheta) + " : f64" : "";
  w.open("module attributes {loom.family = \"llama\"" + tokenizerAttr(c) + "} {");
  w.param("embed", w.t({v, h}), normal(0.02));
  w.param("norm.g", H, "ones");
  if (!c.tiedHead)
    w.param("lm_head", w.t({v, h}), normal(0.02));
  w.blank();
  w.line("// RMSNorm, rotary attention with grouped key/value heads, SwiGLU MLP.");
  w.open("loom.block @layer(%x: " + X + ") -> " + X + " {");
  w.param("attn_norm.g", H, "ones");
  w.param("wq", w.t({h, h}), normal(0.02));
  w.param("wk", w.t({h, kv}), normal(0.02));
  w.param("wv", w.t({h, kv}), normal(0.02));
  w.param("wo", w.t({h, h}), normal(0.02));
  w.param("mlp_norm.g", H, "ones");
  w.param("w_gate", w.t({h, f}), normal(0.02));
  w.param("w_up", w.t({h, f}), normal(0.02));
  w.param("w_down", w.t({f, h}), normal(0.02));
  w.blank();
  w.get("an", "attn_norm.g", H);
  w.op("n1", "loom.rmsnorm %x, %an" + epsAttr(c) + " : " + X + ", " + H);
  w.get("wq", "wq", w.t({h, h}));
  w.get("wk", "wk", w.t({h, kv}));
  w.get("wv", "wv", w.t({h, kv}));
  w.op("q0", "loom.matmul %n1, %wq : " + X + ", " + w.t({h, h}));
  w.op("k0", "loom.matmul %n1, %wk : " + X + ", " + w.t({h, kv}));
  w.op("v", "loom.matmul %n1, %wv : " + X + ", " + w.t({h, kv}));
  w.op("q", "loom.rotary %q0 {num_heads = " + std::to_string(c.heads) + rope + "} : " + X);
  w.op("k", "loom.rotary %k0 {num_heads = " + std::to_string(c.kvHeads) + rope + "} : " + KV);
  w.op("a", "loom.attention %q, %k, %v {causal, num_heads = " + std::to_string(c.heads) +
                ", num_kv_heads = " + std::to_string(c.kvHeads) + "} : " + X + ", " + KV +
                ", " + KV);
  w.get("wo", "wo", w.t({h, h}));
  w.op("o", "loom.matmul %a, %wo : " + X + ", " + w.t({h, h}));
  w.op("r1", "loom.add %x, %o : " + X + ", " + X);
  w.get("mn", "mlp_norm.g", H);
  w.op("n2", "loom.rmsnorm %r1, %mn" + epsAttr(c) + " : " + X + ", " + H);
  w.get("wg", "w_gate", w.t({h, f}));
  w.get("wu", "w_up", w.t({h, f}));
  w.get("wd", "w_down", w.t({f, h}));
  w.op("g0", "loom.matmul %n2, %wg : " + X + ", " + w.t({h, f}));
  w.op("g", "loom.silu %g0 : " + F);
  w.op("u", "loom.matmul %n2, %wu : " + X + ", " + w.t({h, f}));
  w.op("gu", "loom.mul %g, %u : " + F + ", " + F);
  w.op("d", "loom.matmul %gu, %wd : " + F + ", " + w.t({f, h}));
  w.op("y", "loom.add %r1, %d : " + X + ", " + X);
  w.line("loom.yield %y : " + X);
  w.close();
  w.blank();
  std::string tokens = w.ids({kDyn, s}), logits = w.t({kDyn, s, v});
  w.open("func.func @forward(%tokens: " + tokens + ") -> " + logits + " {");
  w.get("embed", "embed", w.t({v, h}));
  w.op("x0", "loom.embedding %embed, %tokens : " + w.t({v, h}) + ", " + tokens);
  w.op("x", "loom.repeat " + std::to_string(c.layers) + " @layer(%x0) : (" + X + ") -> " + X);
  w.get("ng", "norm.g", H);
  w.op("xf", "loom.rmsnorm %x, %ng" + epsAttr(c) + " : " + X + ", " + H);
  w.get("head", c.tiedHead ? "embed" : "lm_head", w.t({v, h}));
  w.op("logits", "loom.matmul %xf, %head {transpose_b} : " + X + ", " + w.t({v, h}));
  w.line("return %logits : " + logits);
  w.close();
  return w.lossAndEnd("tokens", tokens, "targets", tokens, logits);
}

//===----------------------------------------------------------------------===//
// BERT encoder with a masked-language-model head
//===----------------------------------------------------------------------===//

std::string writeBert(const ModelConfig &c) {
  Writer w(c.dtype);
  int64_t h = c.hidden, s = c.seq, v = c.vocab, f = c.ffn;
  std::string X = w.t({kDyn, s, h}), H = w.t({h}), QKV = w.t({kDyn, s, 3 * h}),
              F = w.t({kDyn, s, f});
  w.line("// BERT encoder (post-LayerNorm): " + std::to_string(c.layers) + " layers, hidden " +
         std::to_string(h) + ", " + std::to_string(c.heads) + " heads, sequence " +
         std::to_string(s) + ", vocabulary " + std::to_string(v) +
         ", masked-LM head tied to the word embeddings.");
  w.line("// Written by: loomc models bert --layers " + std::to_string(c.layers) + " --hidden " +
         std::to_string(h) + " --heads " + std::to_string(c.heads) + " --ffn " +
         std::to_string(f) + " --seq " + std::to_string(s) + " --vocab " + std::to_string(v) +
         " --dtype " + c.dtype);
  w.open("module attributes {loom.family = \"bert\"} {");
  w.param("word_emb", w.t({v, h}), normal(0.02));
  w.param("pos_emb", w.t({s, h}), normal(0.02));
  w.param("emb_ln.g", H, "ones");
  w.param("emb_ln.b", H, "zeros");
  w.param("mlm.dense.w", w.t({h, h}), normal(0.02));
  w.param("mlm.dense.b", H, "zeros");
  w.param("mlm.ln.g", H, "ones");
  w.param("mlm.ln.b", H, "zeros");
  w.param("mlm.bias", w.t({v}), "zeros");
  w.blank();
  w.line("// One encoder layer: self-attention and MLP, each followed by add + LayerNorm.");
  w.open("loom.block @layer(%x: " + X + ") -> " + X + " {");
  w.param("attn.qkv.w", w.t({h, 3 * h}), normal(0.02));
  w.param("attn.qkv.b", w.t({3 * h}), "zeros");
  w.param("attn.out.w", w.t({h, h}), normal(0.02));
  w.param("attn.out.b", H, "zeros");
  w.param("ln1.g", H, "ones");
  w.param("ln1.b", H, "zeros");
  w.param("mlp.in.w", w.t({h, f}), normal(0.02));
  w.param("mlp.in.b", w.t({f}), "zeros");
  w.param("mlp.out.w", w.t({f, h}), normal(0.02));
  w.param("mlp.out.b", H, "zeros");
  w.param("ln2.g", H, "ones");
  w.param("ln2.b", H, "zeros");
  w.blank();
  w.get("qkv_w", "attn.qkv.w", w.t({h, 3 * h}));
  w.get("qkv_b", "attn.qkv.b", w.t({3 * h}));
  w.op("qkv0", "loom.matmul %x, %qkv_w : " + X + ", " + w.t({h, 3 * h}));
  w.op("qkv", "loom.add %qkv0, %qkv_b : " + QKV + ", " + w.t({3 * h}));
  w.op("q", "loom.slice %qkv {axis = 2, start = 0, size = " + std::to_string(h) + "} : " + QKV);
  w.op("k", "loom.slice %qkv {axis = 2, start = " + std::to_string(h) + ", size = " +
                std::to_string(h) + "} : " + QKV);
  w.op("v", "loom.slice %qkv {axis = 2, start = " + std::to_string(2 * h) + ", size = " +
                std::to_string(h) + "} : " + QKV);
  w.op("a", "loom.attention %q, %k, %v {num_heads = " + std::to_string(c.heads) + "} : " + X +
                ", " + X + ", " + X);
  w.get("out_w", "attn.out.w", w.t({h, h}));
  w.get("out_b", "attn.out.b", H);
  w.op("o0", "loom.matmul %a, %out_w : " + X + ", " + w.t({h, h}));
  w.op("o", "loom.add %o0, %out_b : " + X + ", " + H);
  w.op("r1", "loom.add %x, %o : " + X + ", " + X);
  w.get("ln1_g", "ln1.g", H);
  w.get("ln1_b", "ln1.b", H);
  w.op("h1", "loom.layernorm %r1, %ln1_g, %ln1_b {eps = 1.0e-12 : f64} : " + X + ", " + H +
                 ", " + H);
  w.get("in_w", "mlp.in.w", w.t({h, f}));
  w.get("in_b", "mlp.in.b", w.t({f}));
  w.op("u0", "loom.matmul %h1, %in_w : " + X + ", " + w.t({h, f}));
  w.op("u1", "loom.add %u0, %in_b : " + F + ", " + w.t({f}));
  w.op("u", "loom.gelu %u1 : " + F);
  w.get("mout_w", "mlp.out.w", w.t({f, h}));
  w.get("mout_b", "mlp.out.b", H);
  w.op("d0", "loom.matmul %u, %mout_w : " + F + ", " + w.t({f, h}));
  w.op("d", "loom.add %d0, %mout_b : " + X + ", " + H);
  w.op("r2", "loom.add %h1, %d : " + X + ", " + X);
  w.get("ln2_g", "ln2.g", H);
  w.get("ln2_b", "ln2.b", H);
  w.op("y", "loom.layernorm %r2, %ln2_g, %ln2_b {eps = 1.0e-12 : f64} : " + X + ", " + H +
                ", " + H);
  w.line("loom.yield %y : " + X);
  w.close();
  w.blank();
  std::string tokens = w.ids({kDyn, s}), logits = w.t({kDyn, s, v});
  w.open("func.func @forward(%tokens: " + tokens + ") -> " + logits + " {");
  w.get("we", "word_emb", w.t({v, h}));
  w.get("pe", "pos_emb", w.t({s, h}));
  w.op("e0", "loom.embedding %we, %tokens : " + w.t({v, h}) + ", " + tokens);
  w.op("e1", "loom.add %e0, %pe : " + X + ", " + w.t({s, h}));
  w.get("eg", "emb_ln.g", H);
  w.get("eb", "emb_ln.b", H);
  w.op("x0", "loom.layernorm %e1, %eg, %eb {eps = 1.0e-12 : f64} : " + X + ", " + H + ", " + H);
  w.op("x", "loom.repeat " + std::to_string(c.layers) + " @layer(%x0) : (" + X + ") -> " + X);
  w.get("dw", "mlm.dense.w", w.t({h, h}));
  w.get("db", "mlm.dense.b", H);
  w.op("m0", "loom.matmul %x, %dw : " + X + ", " + w.t({h, h}));
  w.op("m1", "loom.add %m0, %db : " + X + ", " + H);
  w.op("m2", "loom.gelu %m1 : " + X);
  w.get("mg", "mlm.ln.g", H);
  w.get("mb", "mlm.ln.b", H);
  w.op("m3", "loom.layernorm %m2, %mg, %mb {eps = 1.0e-12 : f64} : " + X + ", " + H + ", " + H);
  w.get("bias", "mlm.bias", w.t({v}));
  w.op("l0", "loom.matmul %m3, %we {transpose_b} : " + X + ", " + w.t({v, h}));
  w.op("logits", "loom.add %l0, %bias : " + logits + ", " + w.t({v}));
  w.line("return %logits : " + logits);
  w.close();
  return w.lossAndEnd("tokens", tokens, "targets", tokens, logits);
}

//===----------------------------------------------------------------------===//
// MLP classifier
//===----------------------------------------------------------------------===//

std::string writeMlp(const ModelConfig &c) {
  Writer w(c.dtype);
  int64_t in = c.inputs, h = c.hidden, k = c.classes;
  std::string I = w.t({kDyn, in}), X = w.t({kDyn, h}), K = w.t({kDyn, k});
  w.line("// MLP classifier: " + std::to_string(in) + " inputs, " + std::to_string(c.layers) +
         " hidden layers of " + std::to_string(h) + " with ReLU, " + std::to_string(k) +
         " classes.");
  w.line("// Written by: loomc models mlp --layers " + std::to_string(c.layers) + " --hidden " +
         std::to_string(h) + " --inputs " + std::to_string(in) + " --classes " +
         std::to_string(k) + " --dtype " + c.dtype);
  w.open("module attributes {loom.family = \"mlp\"} {");
  w.param("in.w", w.t({in, h}), normal(1.0 / std::sqrt(static_cast<double>(in))));
  w.param("in.b", w.t({h}), "zeros");
  w.param("out.w", w.t({h, k}), normal(1.0 / std::sqrt(static_cast<double>(h))));
  w.param("out.b", w.t({k}), "zeros");
  w.blank();
  w.open("loom.block @layer(%x: " + X + ") -> " + X + " {");
  w.param("w", w.t({h, h}), normal(1.0 / std::sqrt(static_cast<double>(h))));
  w.param("b", w.t({h}), "zeros");
  w.get("w", "w", w.t({h, h}));
  w.get("b", "b", w.t({h}));
  w.op("y0", "loom.matmul %x, %w : " + X + ", " + w.t({h, h}));
  w.op("y1", "loom.add %y0, %b : " + X + ", " + w.t({h}));
  w.op("y", "loom.relu %y1 : " + X);
  w.line("loom.yield %y : " + X);
  w.close();
  w.blank();
  w.open("func.func @forward(%input: " + I + ") -> " + K + " {");
  w.get("wi", "in.w", w.t({in, h}));
  w.get("bi", "in.b", w.t({h}));
  w.op("x0", "loom.matmul %input, %wi : " + I + ", " + w.t({in, h}));
  w.op("x1", "loom.add %x0, %bi : " + X + ", " + w.t({h}));
  w.op("x2", "loom.relu %x1 : " + X);
  w.op("x", "loom.repeat " + std::to_string(c.layers) + " @layer(%x2) : (" + X + ") -> " + X);
  w.get("wo", "out.w", w.t({h, k}));
  w.get("bo", "out.b", w.t({k}));
  w.op("l0", "loom.matmul %x, %wo : " + X + ", " + w.t({h, k}));
  w.op("logits", "loom.add %l0, %bo : " + K + ", " + w.t({k}));
  w.line("return %logits : " + K);
  w.close();
  return w.lossAndEnd("input", I, "labels", w.ids({kDyn}), K);
}

//===----------------------------------------------------------------------===//
// ResNet-50 (v1.5: the stride sits on the 3x3 convolution)
//===----------------------------------------------------------------------===//

/// Writes one bottleneck block. `project` adds the strided 1x1 shortcut.
void writeBottleneck(Writer &w, const std::string &name, int64_t in, int64_t mid, int64_t out,
                     int64_t size, int64_t stride, bool project) {
  int64_t outSize = (size - 1) / stride + 1;
  std::string X = w.t({kDyn, in, size, size}), M1 = w.t({kDyn, mid, size, size}),
              M2 = w.t({kDyn, mid, outSize, outSize}), Y = w.t({kDyn, out, outSize, outSize});
  auto kaiming = [](int64_t fanIn) { return normal(std::sqrt(2.0 / fanIn)); };
  w.open("loom.block @" + name + "(%x: " + X + ") -> " + Y + " {");
  w.param("conv1.w", w.t({mid, in, 1, 1}), kaiming(in));
  w.param("bn1.g", w.t({mid}), "ones");
  w.param("bn1.b", w.t({mid}), "zeros");
  w.param("conv2.w", w.t({mid, mid, 3, 3}), kaiming(mid * 9));
  w.param("bn2.g", w.t({mid}), "ones");
  w.param("bn2.b", w.t({mid}), "zeros");
  w.param("conv3.w", w.t({out, mid, 1, 1}), kaiming(mid));
  w.param("bn3.g", w.t({out}), "ones");
  w.param("bn3.b", w.t({out}), "zeros");
  if (project) {
    w.param("down.w", w.t({out, in, 1, 1}), kaiming(in));
    w.param("down_bn.g", w.t({out}), "ones");
    w.param("down_bn.b", w.t({out}), "zeros");
  }
  auto convBn = [&](const std::string &tag, const std::string &input, const std::string &inType,
                    const std::string &outType, int64_t cin, int64_t cout, int64_t k,
                    int64_t s, int64_t pad, const std::string &conv, const std::string &bn) {
    std::string wt = w.t({cout, cin, k, k}), ct = w.t({cout});
    w.get(tag + "_w", conv + ".w", wt);
    std::string attrs;
    if (s != 1 || pad != 0)
      attrs = " {" + std::string(pad ? "padding = " + std::to_string(pad) : "") +
              (pad && s != 1 ? ", " : "") + (s != 1 ? "stride = " + std::to_string(s) : "") +
              "}";
    w.op(tag + "_c", "loom.conv2d %" + input + ", %" + tag + "_w" + attrs + " : " + inType +
                         ", " + wt);
    w.get(tag + "_g", bn + ".g", ct);
    w.get(tag + "_b", bn + ".b", ct);
    w.op(tag, "loom.batchnorm %" + tag + "_c, %" + tag + "_g, %" + tag + "_b : " + outType +
                  ", " + ct + ", " + ct);
  };
  convBn("c1", "x", X, M1, in, mid, 1, 1, 0, "conv1", "bn1");
  w.op("a1", "loom.relu %c1 : " + M1);
  convBn("c2", "a1", M1, M2, mid, mid, 3, stride, 1, "conv2", "bn2");
  w.op("a2", "loom.relu %c2 : " + M2);
  convBn("c3", "a2", M2, Y, mid, out, 1, 1, 0, "conv3", "bn3");
  std::string shortcut = "x";
  if (project) {
    convBn("sc", "x", X, Y, in, out, 1, stride, 0, "down", "down_bn");
    shortcut = "sc";
  }
  w.op("s", "loom.add %c3, %" + shortcut + " : " + Y + ", " + Y);
  w.op("y", "loom.relu %s : " + Y);
  w.line("loom.yield %y : " + Y);
  w.close();
  w.blank();
}

std::string writeResnet(const ModelConfig &c) {
  Writer w(c.dtype);
  int64_t img = c.image, k = c.classes;
  int64_t stemSize = (img + 2 * 3 - 7) / 2 + 1;
  int64_t poolSize = (stemSize + 2 * 1 - 3) / 2 + 1;
  struct Stage {
    int64_t mid, out, blocks, stride;
  };
  const Stage stages[] = {{64, 256, 3, 1}, {128, 512, 4, 2}, {256, 1024, 6, 2}, {512, 2048, 3, 2}};

  w.line("// ResNet-50 (v1.5) for " + std::to_string(img) + "x" + std::to_string(img) +
         " images and " + std::to_string(k) + " classes; each stage's repeated bottleneck is "
         "written once.");
  w.line("// Written by: loomc models resnet --image " + std::to_string(img) + " --classes " +
         std::to_string(k) + " --dtype " + c.dtype);
  w.open("module attributes {loom.family = \"resnet\"} {");
  w.param("stem.w", w.t({64, 3, 7, 7}), normal(std::sqrt(2.0 / (3 * 49))));
  w.param("stem_bn.g", w.t({64}), "ones");
  w.param("stem_bn.b", w.t({64}), "zeros");
  w.param("fc.w", w.t({2048, k}), normal(0.01));
  w.param("fc.b", w.t({k}), "zeros");
  w.blank();
  int64_t channels = 64, size = poolSize;
  for (int i = 0; i < 4; ++i) {
    const Stage &st = stages[i];
    std::string base = "stage" + std::to_string(i + 1);
    writeBottleneck(w, base + "_first", channels, st.mid, st.out, size, st.stride, true);
    size = (size - 1) / st.stride + 1;
    writeBottleneck(w, base, st.out, st.mid, st.out, size, 1, false);
    channels = st.out;
  }
  std::string I = w.t({kDyn, 3, img, img}), S = w.t({kDyn, 64, stemSize, stemSize}),
              P = w.t({kDyn, 64, poolSize, poolSize}), K = w.t({kDyn, k});
  w.open("func.func @forward(%images: " + I + ") -> " + K + " {");
  w.get("stem_w", "stem.w", w.t({64, 3, 7, 7}));
  w.op("s0", "loom.conv2d %images, %stem_w {padding = 3, stride = 2} : " + I + ", " +
                 w.t({64, 3, 7, 7}));
  w.get("stem_g", "stem_bn.g", w.t({64}));
  w.get("stem_b", "stem_bn.b", w.t({64}));
  w.op("s1", "loom.batchnorm %s0, %stem_g, %stem_b : " + S + ", " + w.t({64}) + ", " +
                 w.t({64}));
  w.op("s2", "loom.relu %s1 : " + S);
  w.op("x0", "loom.max_pool2d %s2 {kernel = 3, padding = 1, stride = 2} : " + S);
  channels = 64;
  size = poolSize;
  std::string prev = "x0", prevType = P;
  for (int i = 0; i < 4; ++i) {
    const Stage &st = stages[i];
    std::string base = "stage" + std::to_string(i + 1);
    size = (size - 1) / st.stride + 1;
    std::string Y = w.t({kDyn, st.out, size, size});
    std::string first = "x" + std::to_string(i + 1) + "a", rest = "x" + std::to_string(i + 1);
    w.op(first, "loom.repeat 1 @" + base + "_first(%" + prev + ") : (" + prevType + ") -> " + Y);
    w.op(rest, "loom.repeat " + std::to_string(st.blocks - 1) + " @" + base + "(%" + first +
                   ") : (" + Y + ") -> " + Y);
    prev = rest;
    prevType = Y;
  }
  w.op("pooled", "loom.reduce_mean %" + prev + " {axes = array<i64: 2, 3>} : " + prevType);
  w.get("fc_w", "fc.w", w.t({2048, k}));
  w.get("fc_b", "fc.b", w.t({k}));
  w.op("l0", "loom.matmul %pooled, %fc_w : " + w.t({kDyn, 2048}) + ", " + w.t({2048, k}));
  w.op("logits", "loom.add %l0, %fc_b : " + K + ", " + w.t({k}));
  w.line("return %logits : " + K);
  w.close();
  return w.lossAndEnd("images", I, "labels", w.ids({kDyn}), K);
}

bool positive(int64_t v) { return v > 0; }

} // namespace

std::string mlir::loom::applyDefaults(ModelConfig &c) {
  auto set = [](int64_t &field, int64_t value) {
    if (field == 0)
      field = value;
  };
  if (c.family == "gpt") {
    set(c.layers, 12), set(c.hidden, 768), set(c.heads, 12), set(c.seq, 1024);
    set(c.vocab, 50257), set(c.ffn, 4 * c.hidden);
  } else if (c.family == "llama") {
    set(c.layers, 22), set(c.hidden, 2048), set(c.heads, 32), set(c.kvHeads, 4);
    set(c.ffn, 5632), set(c.seq, 2048), set(c.vocab, 32000);
  } else if (c.family == "bert") {
    set(c.layers, 12), set(c.hidden, 768), set(c.heads, 12), set(c.seq, 512);
    set(c.vocab, 30522), set(c.ffn, 4 * c.hidden);
  } else if (c.family == "mlp") {
    set(c.layers, 2), set(c.hidden, 256), set(c.inputs, 784), set(c.classes, 10);
  } else if (c.family == "resnet") {
    set(c.image, 224), set(c.classes, 1000);
    c.layers = 50;
  } else {
    return "unknown model family '" + c.family + "'; expected gpt, llama, bert, mlp or resnet";
  }
  return "";
}

bool mlir::loom::writeModel(const ModelConfig &c, std::string &text, std::string &error) {
  if (c.dtype != "f32" && c.dtype != "bf16" && c.dtype != "f16" && c.dtype != "f64") {
    error = "unknown dtype '" + c.dtype + "'; expected f32, bf16, f16 or f64";
    return false;
  }
  if (c.layers > RepeatOp::kMaxCount) {
    error = "--layers must be at most " + std::to_string(RepeatOp::kMaxCount) +
            " (loom.repeat's limit), got " + std::to_string(c.layers);
    return false;
  }
  if (c.family == "gpt" || c.family == "llama" || c.family == "bert") {
    for (auto [name, v] : {std::pair{"--layers", c.layers}, {"--hidden", c.hidden},
                           {"--heads", c.heads}, {"--seq", c.seq}, {"--vocab", c.vocab},
                           {"--ffn", c.ffn}})
      if (!positive(v)) {
        error = std::string(name) + " must be positive, got " + std::to_string(v);
        return false;
      }
    if (c.hidden % c.heads != 0) {
      error = "--hidden " + std::to_string(c.hidden) + " is not divisible by --heads " +
              std::to_string(c.heads);
      return false;
    }
  }
  if (c.family == "gpt") {
    text = writeGpt(c);
  } else if (c.family == "llama") {
    if (!positive(c.kvHeads) || c.heads % c.kvHeads != 0) {
      error = "--heads " + std::to_string(c.heads) + " must be a positive multiple of --kv-heads " +
              std::to_string(c.kvHeads);
      return false;
    }
    if ((c.hidden / c.heads) % 2 != 0) {
      error = "rotary embeddings need an even head dimension, got " +
              std::to_string(c.hidden / c.heads);
      return false;
    }
    text = writeLlama(c);
  } else if (c.family == "bert") {
    text = writeBert(c);
  } else if (c.family == "mlp") {
    for (auto [name, v] : {std::pair{"--layers", c.layers}, {"--hidden", c.hidden},
                           {"--inputs", c.inputs}, {"--classes", c.classes}})
      if (!positive(v)) {
        error = std::string(name) + " must be positive, got " + std::to_string(v);
        return false;
      }
    text = writeMlp(c);
  } else if (c.family == "resnet") {
    if (c.image < 32 || !positive(c.classes)) {
      error = "resnet needs --image >= 32 and --classes >= 1";
      return false;
    }
    text = writeResnet(c);
  } else {
    error = "unknown model family '" + c.family + "'; expected gpt, llama, bert, mlp or resnet";
    return false;
  }
  return true;
}
