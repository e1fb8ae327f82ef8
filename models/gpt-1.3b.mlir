// GPT-2 style decoder: 24 layers, hidden 2048, 16 heads, sequence 1024, vocabulary 50304, tied embeddings.
// Written by: loomc models gpt --layers 24 --hidden 2048 --heads 16 --seq 1024 --vocab 50304 --ffn 8192 --dtype f32
module attributes {loom.family = "gpt"} {
  loom.param @wte : tensor<50304x2048xf32> init <normal(0.02)>
  loom.param @wpe : tensor<1024x2048xf32> init <normal(0.01)>
  loom.param @ln_f.g : tensor<2048xf32> init <ones>
  loom.param @ln_f.b : tensor<2048xf32> init <zeros>

  // One pre-LayerNorm transformer layer; loom.repeat applies it per layer.
  loom.block @layer(%x: tensor<?x1024x2048xf32>) -> tensor<?x1024x2048xf32> {
    loom.param @ln1.g : tensor<2048xf32> init <ones>
    loom.param @ln1.b : tensor<2048xf32> init <zeros>
    loom.param @attn.qkv.w : tensor<2048x6144xf32> init <normal(0.02)>
    loom.param @attn.qkv.b : tensor<6144xf32> init <zeros>
    loom.param @attn.proj.w : tensor<2048x2048xf32> init <normal(0.00288675)>
    loom.param @attn.proj.b : tensor<2048xf32> init <zeros>
    loom.param @ln2.g : tensor<2048xf32> init <ones>
    loom.param @ln2.b : tensor<2048xf32> init <zeros>
    loom.param @mlp.fc.w : tensor<2048x8192xf32> init <normal(0.02)>
    loom.param @mlp.fc.b : tensor<8192xf32> init <zeros>
    loom.param @mlp.proj.w : tensor<8192x2048xf32> init <normal(0.00288675)>
    loom.param @mlp.proj.b : tensor<2048xf32> init <zeros>

    %ln1_g = loom.get @ln1.g : tensor<2048xf32>
    %ln1_b = loom.get @ln1.b : tensor<2048xf32>
    %h1 = loom.layernorm %x, %ln1_g, %ln1_b : tensor<?x1024x2048xf32>, tensor<2048xf32>, tensor<2048xf32>
    %qkv_w = loom.get @attn.qkv.w : tensor<2048x6144xf32>
    %qkv_b = loom.get @attn.qkv.b : tensor<6144xf32>
    %qkv0 = loom.matmul %h1, %qkv_w : tensor<?x1024x2048xf32>, tensor<2048x6144xf32>
    %qkv = loom.add %qkv0, %qkv_b : tensor<?x1024x6144xf32>, tensor<6144xf32>
    %q = loom.slice %qkv {axis = 2, start = 0, size = 2048} : tensor<?x1024x6144xf32>
    %k = loom.slice %qkv {axis = 2, start = 2048, size = 2048} : tensor<?x1024x6144xf32>
    %v = loom.slice %qkv {axis = 2, start = 4096, size = 2048} : tensor<?x1024x6144xf32>
    %a = loom.attention %q, %k, %v {causal, num_heads = 16} : tensor<?x1024x2048xf32>, tensor<?x1024x2048xf32>, tensor<?x1024x2048xf32>
    %proj_w = loom.get @attn.proj.w : tensor<2048x2048xf32>
    %proj_b = loom.get @attn.proj.b : tensor<2048xf32>
    %o0 = loom.matmul %a, %proj_w : tensor<?x1024x2048xf32>, tensor<2048x2048xf32>
    %o = loom.add %o0, %proj_b : tensor<?x1024x2048xf32>, tensor<2048xf32>
    %r1 = loom.add %x, %o : tensor<?x1024x2048xf32>, tensor<?x1024x2048xf32>
    %ln2_g = loom.get @ln2.g : tensor<2048xf32>
    %ln2_b = loom.get @ln2.b : tensor<2048xf32>
    %h2 = loom.layernorm %r1, %ln2_g, %ln2_b : tensor<?x1024x2048xf32>, tensor<2048xf32>, tensor<2048xf32>
    %fc_w = loom.get @mlp.fc.w : tensor<2048x8192xf32>
    %fc_b = loom.get @mlp.fc.b : tensor<8192xf32>
    %u0 = loom.matmul %h2, %fc_w : tensor<?x1024x2048xf32>, tensor<2048x8192xf32>
    %u1 = loom.add %u0, %fc_b : tensor<?x1024x8192xf32>, tensor<8192xf32>
    %u = loom.gelu %u1 {approximate} : tensor<?x1024x8192xf32>
    %mproj_w = loom.get @mlp.proj.w : tensor<8192x2048xf32>
    %mproj_b = loom.get @mlp.proj.b : tensor<2048xf32>
    %d0 = loom.matmul %u, %mproj_w : tensor<?x1024x8192xf32>, tensor<8192x2048xf32>
    %d = loom.add %d0, %mproj_b : tensor<?x1024x2048xf32>, tensor<2048xf32>
    %y = loom.add %r1, %d : tensor<?x1024x2048xf32>, tensor<?x1024x2048xf32>
    loom.yield %y : tensor<?x1024x2048xf32>
  }

  func.func @forward(%tokens: tensor<?x1024xi32>) -> tensor<?x1024x50304xf32> {
    %wte = loom.get @wte : tensor<50304x2048xf32>
    %wpe = loom.get @wpe : tensor<1024x2048xf32>
    %tok = loom.embedding %wte, %tokens : tensor<50304x2048xf32>, tensor<?x1024xi32>
    %x0 = loom.add %tok, %wpe : tensor<?x1024x2048xf32>, tensor<1024x2048xf32>
    %x = loom.repeat 24 @layer(%x0) : (tensor<?x1024x2048xf32>) -> tensor<?x1024x2048xf32>
    %lnf_g = loom.get @ln_f.g : tensor<2048xf32>
    %lnf_b = loom.get @ln_f.b : tensor<2048xf32>
    %xf = loom.layernorm %x, %lnf_g, %lnf_b : tensor<?x1024x2048xf32>, tensor<2048xf32>, tensor<2048xf32>
    %logits = loom.matmul %xf, %wte {transpose_b} : tensor<?x1024x2048xf32>, tensor<50304x2048xf32>
    return %logits : tensor<?x1024x50304xf32>
  }

  func.func @loss(%tokens: tensor<?x1024xi32>, %targets: tensor<?x1024xi32>) -> tensor<f32> {
    %logits = call @forward(%tokens) : (tensor<?x1024xi32>) -> tensor<?x1024x50304xf32>
    %loss = loom.cross_entropy %logits, %targets : tensor<?x1024x50304xf32>, tensor<?x1024xi32>
    return %loss : tensor<f32>
  }
}
