// BERT encoder (post-LayerNorm): 2 layers, hidden 64, 4 heads, sequence 32, vocabulary 256, masked-LM head tied to the word embeddings.
// Written by: loomc models bert --layers 2 --hidden 64 --heads 4 --ffn 256 --seq 32 --vocab 256 --dtype f32
module attributes {loom.family = "bert"} {
  loom.param @word_emb : tensor<256x64xf32> init <normal(0.02)>
  loom.param @pos_emb : tensor<32x64xf32> init <normal(0.02)>
  loom.param @emb_ln.g : tensor<64xf32> init <ones>
  loom.param @emb_ln.b : tensor<64xf32> init <zeros>
  loom.param @mlm.dense.w : tensor<64x64xf32> init <normal(0.02)>
  loom.param @mlm.dense.b : tensor<64xf32> init <zeros>
  loom.param @mlm.ln.g : tensor<64xf32> init <ones>
  loom.param @mlm.ln.b : tensor<64xf32> init <zeros>
  loom.param @mlm.bias : tensor<256xf32> init <zeros>

  // One encoder layer: self-attention and MLP, each followed by add + LayerNorm.
  loom.block @layer(%x: tensor<?x32x64xf32>) -> tensor<?x32x64xf32> {
    loom.param @attn.qkv.w : tensor<64x192xf32> init <normal(0.02)>
    loom.param @attn.qkv.b : tensor<192xf32> init <zeros>
    loom.param @attn.out.w : tensor<64x64xf32> init <normal(0.02)>
    loom.param @attn.out.b : tensor<64xf32> init <zeros>
    loom.param @ln1.g : tensor<64xf32> init <ones>
    loom.param @ln1.b : tensor<64xf32> init <zeros>
    loom.param @mlp.in.w : tensor<64x256xf32> init <normal(0.02)>
    loom.param @mlp.in.b : tensor<256xf32> init <zeros>
    loom.param @mlp.out.w : tensor<256x64xf32> init <normal(0.02)>
    loom.param @mlp.out.b : tensor<64xf32> init <zeros>
    loom.param @ln2.g : tensor<64xf32> init <ones>
    loom.param @ln2.b : tensor<64xf32> init <zeros>

    %qkv_w = loom.get @attn.qkv.w : tensor<64x192xf32>
    %qkv_b = loom.get @attn.qkv.b : tensor<192xf32>
    %qkv0 = loom.matmul %x, %qkv_w : tensor<?x32x64xf32>, tensor<64x192xf32>
    %qkv = loom.add %qkv0, %qkv_b : tensor<?x32x192xf32>, tensor<192xf32>
    %q = loom.slice %qkv {axis = 2, start = 0, size = 64} : tensor<?x32x192xf32>
    %k = loom.slice %qkv {axis = 2, start = 64, size = 64} : tensor<?x32x192xf32>
    %v = loom.slice %qkv {axis = 2, start = 128, size = 64} : tensor<?x32x192xf32>
    %a = loom.attention %q, %k, %v {num_heads = 4} : tensor<?x32x64xf32>, tensor<?x32x64xf32>, tensor<?x32x64xf32>
    %out_w = loom.get @attn.out.w : tensor<64x64xf32>
    %out_b = loom.get @attn.out.b : tensor<64xf32>
    %o0 = loom.matmul %a, %out_w : tensor<?x32x64xf32>, tensor<64x64xf32>
    %o = loom.add %o0, %out_b : tensor<?x32x64xf32>, tensor<64xf32>
    %r1 = loom.add %x, %o : tensor<?x32x64xf32>, tensor<?x32x64xf32>
    %ln1_g = loom.get @ln1.g : tensor<64xf32>
    %ln1_b = loom.get @ln1.b : tensor<64xf32>
    %h1 = loom.layernorm %r1, %ln1_g, %ln1_b {eps = 1.0e-12 : f64} : tensor<?x32x64xf32>, tensor<64xf32>, tensor<64xf32>
    %in_w = loom.get @mlp.in.w : tensor<64x256xf32>
    %in_b = loom.get @mlp.in.b : tensor<256xf32>
    %u0 = loom.matmul %h1, %in_w : tensor<?x32x64xf32>, tensor<64x256xf32>
    %u1 = loom.add %u0, %in_b : tensor<?x32x256xf32>, tensor<256xf32>
    %u = loom.gelu %u1 : tensor<?x32x256xf32>
    %mout_w = loom.get @mlp.out.w : tensor<256x64xf32>
    %mout_b = loom.get @mlp.out.b : tensor<64xf32>
    %d0 = loom.matmul %u, %mout_w : tensor<?x32x256xf32>, tensor<256x64xf32>
    %d = loom.add %d0, %mout_b : tensor<?x32x64xf32>, tensor<64xf32>
    %r2 = loom.add %h1, %d : tensor<?x32x64xf32>, tensor<?x32x64xf32>
    %ln2_g = loom.get @ln2.g : tensor<64xf32>
    %ln2_b = loom.get @ln2.b : tensor<64xf32>
    %y = loom.layernorm %r2, %ln2_g, %ln2_b {eps = 1.0e-12 : f64} : tensor<?x32x64xf32>, tensor<64xf32>, tensor<64xf32>
    loom.yield %y : tensor<?x32x64xf32>
  }

  func.func @forward(%tokens: tensor<?x32xi32>) -> tensor<?x32x256xf32> {
    %we = loom.get @word_emb : tensor<256x64xf32>
    %pe = loom.get @pos_emb : tensor<32x64xf32>
    %e0 = loom.embedding %we, %tokens : tensor<256x64xf32>, tensor<?x32xi32>
    %e1 = loom.add %e0, %pe : tensor<?x32x64xf32>, tensor<32x64xf32>
    %eg = loom.get @emb_ln.g : tensor<64xf32>
    %eb = loom.get @emb_ln.b : tensor<64xf32>
    %x0 = loom.layernorm %e1, %eg, %eb {eps = 1.0e-12 : f64} : tensor<?x32x64xf32>, tensor<64xf32>, tensor<64xf32>
    %x = loom.repeat 2 @layer(%x0) : (tensor<?x32x64xf32>) -> tensor<?x32x64xf32>
    %dw = loom.get @mlm.dense.w : tensor<64x64xf32>
    %db = loom.get @mlm.dense.b : tensor<64xf32>
    %m0 = loom.matmul %x, %dw : tensor<?x32x64xf32>, tensor<64x64xf32>
    %m1 = loom.add %m0, %db : tensor<?x32x64xf32>, tensor<64xf32>
    %m2 = loom.gelu %m1 : tensor<?x32x64xf32>
    %mg = loom.get @mlm.ln.g : tensor<64xf32>
    %mb = loom.get @mlm.ln.b : tensor<64xf32>
    %m3 = loom.layernorm %m2, %mg, %mb {eps = 1.0e-12 : f64} : tensor<?x32x64xf32>, tensor<64xf32>, tensor<64xf32>
    %bias = loom.get @mlm.bias : tensor<256xf32>
    %l0 = loom.matmul %m3, %we {transpose_b} : tensor<?x32x64xf32>, tensor<256x64xf32>
    %logits = loom.add %l0, %bias : tensor<?x32x256xf32>, tensor<256xf32>
    return %logits : tensor<?x32x256xf32>
  }

  func.func @loss(%tokens: tensor<?x32xi32>, %targets: tensor<?x32xi32>) -> tensor<f32> {
    %logits = call @forward(%tokens) : (tensor<?x32xi32>) -> tensor<?x32x256xf32>
    %loss = loom.cross_entropy %logits, %targets : tensor<?x32x256xf32>, tensor<?x32xi32>
    return %loss : tensor<f32>
  }
}
