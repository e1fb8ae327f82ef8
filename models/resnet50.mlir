// ResNet-50 (v1.5) for 224x224 images and 1000 classes; each stage's repeated bottleneck is written once.
// Written by: loomc models resnet --image 224 --classes 1000 --dtype f32
module attributes {loom.family = "resnet"} {
  loom.param @stem.w : tensor<64x3x7x7xf32> init <normal(0.116642)>
  loom.param @stem_bn.g : tensor<64xf32> init <ones>
  loom.param @stem_bn.b : tensor<64xf32> init <zeros>
  loom.param @fc.w : tensor<2048x1000xf32> init <normal(0.01)>
  loom.param @fc.b : tensor<1000xf32> init <zeros>

  loom.block @stage1_first(%x: tensor<?x64x56x56xf32>) -> tensor<?x256x56x56xf32> {
    loom.param @conv1.w : tensor<64x64x1x1xf32> init <normal(0.176777)>
    loom.param @bn1.g : tensor<64xf32> init <ones>
    loom.param @bn1.b : tensor<64xf32> init <zeros>
    loom.param @conv2.w : tensor<64x64x3x3xf32> init <normal(0.0589256)>
    loom.param @bn2.g : tensor<64xf32> init <ones>
    loom.param @bn2.b : tensor<64xf32> init <zeros>
    loom.param @conv3.w : tensor<256x64x1x1xf32> init <normal(0.176777)>
    loom.param @bn3.g : tensor<256xf32> init <ones>
    loom.param @bn3.b : tensor<256xf32> init <zeros>
    loom.param @down.w : tensor<256x64x1x1xf32> init <normal(0.176777)>
    loom.param @down_bn.g : tensor<256xf32> init <ones>
    loom.param @down_bn.b : tensor<256xf32> init <zeros>
    %c1_w = loom.get @conv1.w : tensor<64x64x1x1xf32>
    %c1_c = loom.conv2d %x, %c1_w : tensor<?x64x56x56xf32>, tensor<64x64x1x1xf32>
    %c1_g = loom.get @bn1.g : tensor<64xf32>
    %c1_b = loom.get @bn1.b : tensor<64xf32>
    %c1 = loom.batchnorm %c1_c, %c1_g, %c1_b : tensor<?x64x56x56xf32>, tensor<64xf32>, tensor<64xf32>
    %a1 = loom.relu %c1 : tensor<?x64x56x56xf32>
    %c2_w = loom.get @conv2.w : tensor<64x64x3x3xf32>
    %c2_c = loom.conv2d %a1, %c2_w {padding = 1} : tensor<?x64x56x56xf32>, tensor<64x64x3x3xf32>
    %c2_g = loom.get @bn2.g : tensor<64xf32>
    %c2_b = loom.get @bn2.b : tensor<64xf32>
    %c2 = loom.batchnorm %c2_c, %c2_g, %c2_b : tensor<?x64x56x56xf32>, tensor<64xf32>, tensor<64xf32>
    %a2 = loom.relu %c2 : tensor<?x64x56x56xf32>
    %c3_w = loom.get @conv3.w : tensor<256x64x1x1xf32>
    %c3_c = loom.conv2d %a2, %c3_w : tensor<?x64x56x56xf32>, tensor<256x64x1x1xf32>
    %c3_g = loom.get @bn3.g : tensor<256xf32>
    %c3_b = loom.get @bn3.b : tensor<256xf32>
    %c3 = loom.batchnorm %c3_c, %c3_g, %c3_b : tensor<?x256x56x56xf32>, tensor<256xf32>, tensor<256xf32>
    %sc_w = loom.get @down.w : tensor<256x64x1x1xf32>
    %sc_c = loom.conv2d %x, %sc_w : tensor<?x64x56x56xf32>, tensor<256x64x1x1xf32>
    %sc_g = loom.get @down_bn.g : tensor<256xf32>
    %sc_b = loom.get @down_bn.b : tensor<256xf32>
    %sc = loom.batchnorm %sc_c, %sc_g, %sc_b : tensor<?x256x56x56xf32>, tensor<256xf32>, tensor<256xf32>
    %s = loom.add %c3, %sc : tensor<?x256x56x56xf32>, tensor<?x256x56x56xf32>
    %y = loom.relu %s : tensor<?x256x56x56xf32>
    loom.yield %y : tensor<?x256x56x56xf32>
  }

  loom.block @stage1(%x: tensor<?x256x56x56xf32>) -> tensor<?x256x56x56xf32> {
    loom.param @conv1.w : tensor<64x256x1x1xf32> init <normal(0.0883883)>
    loom.param @bn1.g : tensor<64xf32> init <ones>
    loom.param @bn1.b : tensor<64xf32> init <zeros>
    loom.param @conv2.w : tensor<64x64x3x3xf32> init <normal(0.0589256)>
    loom.param @bn2.g : tensor<64xf32> init <ones>
    loom.param @bn2.b : tensor<64xf32> init <zeros>
    loom.param @conv3.w : tensor<256x64x1x1xf32> init <normal(0.176777)>
    loom.param @bn3.g : tensor<256xf32> init <ones>
    loom.param @bn3.b : tensor<256xf32> init <zeros>
    %c1_w = loom.get @conv1.w : tensor<64x256x1x1xf32>
    %c1_c = loom.conv2d %x, %c1_w : tensor<?x256x56x56xf32>, tensor<64x256x1x1xf32>
    %c1_g = loom.get @bn1.g : tensor<64xf32>
    %c1_b = loom.get @bn1.b : tensor<64xf32>
    %c1 = loom.batchnorm %c1_c, %c1_g, %c1_b : tensor<?x64x56x56xf32>, tensor<64xf32>, tensor<64xf32>
    %a1 = loom.relu %c1 : tensor<?x64x56x56xf32>
    %c2_w = loom.get @conv2.w : tensor<64x64x3x3xf32>
    %c2_c = loom.conv2d %a1, %c2_w {padding = 1} : tensor<?x64x56x56xf32>, tensor<64x64x3x3xf32>
    %c2_g = loom.get @bn2.g : tensor<64xf32>
    %c2_b = loom.get @bn2.b : tensor<64xf32>
    %c2 = loom.batchnorm %c2_c, %c2_g, %c2_b : tensor<?x64x56x56xf32>, tensor<64xf32>, tensor<64xf32>
    %a2 = loom.relu %c2 : tensor<?x64x56x56xf32>
    %c3_w = loom.get @conv3.w : tensor<256x64x1x1xf32>
    %c3_c = loom.conv2d %a2, %c3_w : tensor<?x64x56x56xf32>, tensor<256x64x1x1xf32>
    %c3_g = loom.get @bn3.g : tensor<256xf32>
    %c3_b = loom.get @bn3.b : tensor<256xf32>
    %c3 = loom.batchnorm %c3_c, %c3_g, %c3_b : tensor<?x256x56x56xf32>, tensor<256xf32>, tensor<256xf32>
    %s = loom.add %c3, %x : tensor<?x256x56x56xf32>, tensor<?x256x56x56xf32>
    %y = loom.relu %s : tensor<?x256x56x56xf32>
    loom.yield %y : tensor<?x256x56x56xf32>
  }

  loom.block @stage2_first(%x: tensor<?x256x56x56xf32>) -> tensor<?x512x28x28xf32> {
    loom.param @conv1.w : tensor<128x256x1x1xf32> init <normal(0.0883883)>
    loom.param @bn1.g : tensor<128xf32> init <ones>
    loom.param @bn1.b : tensor<128xf32> init <zeros>
    loom.param @conv2.w : tensor<128x128x3x3xf32> init <normal(0.0416667)>
    loom.param @bn2.g : tensor<128xf32> init <ones>
    loom.param @bn2.b : tensor<128xf32> init <zeros>
    loom.param @conv3.w : tensor<512x128x1x1xf32> init <normal(0.125)>
    loom.param @bn3.g : tensor<512xf32> init <ones>
    loom.param @bn3.b : tensor<512xf32> init <zeros>
    loom.param @down.w : tensor<512x256x1x1xf32> init <normal(0.0883883)>
    loom.param @down_bn.g : tensor<512xf32> init <ones>
    loom.param @down_bn.b : tensor<512xf32> init <zeros>
    %c1_w = loom.get @conv1.w : tensor<128x256x1x1xf32>
    %c1_c = loom.conv2d %x, %c1_w : tensor<?x256x56x56xf32>, tensor<128x256x1x1xf32>
    %c1_g = loom.get @bn1.g : tensor<128xf32>
    %c1_b = loom.get @bn1.b : tensor<128xf32>
    %c1 = loom.batchnorm %c1_c, %c1_g, %c1_b : tensor<?x128x56x56xf32>, tensor<128xf32>, tensor<128xf32>
    %a1 = loom.relu %c1 : tensor<?x128x56x56xf32>
    %c2_w = loom.get @conv2.w : tensor<128x128x3x3xf32>
    %c2_c = loom.conv2d %a1, %c2_w {padding = 1, stride = 2} : tensor<?x128x56x56xf32>, tensor<128x128x3x3xf32>
    %c2_g = loom.get @bn2.g : tensor<128xf32>
    %c2_b = loom.get @bn2.b : tensor<128xf32>
    %c2 = loom.batchnorm %c2_c, %c2_g, %c2_b : tensor<?x128x28x28xf32>, tensor<128xf32>, tensor<128xf32>
    %a2 = loom.relu %c2 : tensor<?x128x28x28xf32>
    %c3_w = loom.get @conv3.w : tensor<512x128x1x1xf32>
    %c3_c = loom.conv2d %a2, %c3_w : tensor<?x128x28x28xf32>, tensor<512x128x1x1xf32>
    %c3_g = loom.get @bn3.g : tensor<512xf32>
    %c3_b = loom.get @bn3.b : tensor<512xf32>
    %c3 = loom.batchnorm %c3_c, %c3_g, %c3_b : tensor<?x512x28x28xf32>, tensor<512xf32>, tensor<512xf32>
    %sc_w = loom.get @down.w : tensor<512x256x1x1xf32>
    %sc_c = loom.conv2d %x, %sc_w {stride = 2} : tensor<?x256x56x56xf32>, tensor<512x256x1x1xf32>
    %sc_g = loom.get @down_bn.g : tensor<512xf32>
    %sc_b = loom.get @down_bn.b : tensor<512xf32>
    %sc = loom.batchnorm %sc_c, %sc_g, %sc_b : tensor<?x512x28x28xf32>, tensor<512xf32>, tensor<512xf32>
    %s = loom.add %c3, %sc : tensor<?x512x28x28xf32>, tensor<?x512x28x28xf32>
    %y = loom.relu %s : tensor<?x512x28x28xf32>
    loom.yield %y : tensor<?x512x28x28xf32>
  }

  loom.block @stage2(%x: tensor<?x512x28x28xf32>) -> tensor<?x512x28x28xf32> {
    loom.param @conv1.w : tensor<128x512x1x1xf32> init <normal(0.0625)>
    loom.param @bn1.g : tensor<128xf32> init <ones>
    loom.param @bn1.b : tensor<128xf32> init <zeros>
    loom.param @conv2.w : tensor<128x128x3x3xf32> init <normal(0.0416667)>
    loom.param @bn2.g : tensor<128xf32> init <ones>
    loom.param @bn2.b : tensor<128xf32> init <zeros>
    loom.param @conv3.w : tensor<512x128x1x1xf32> init <normal(0.125)>
    loom.param @bn3.g : tensor<512xf32> init <ones>
    loom.param @bn3.b : tensor<512xf32> init <zeros>
    %c1_w = loom.get @conv1.w : tensor<128x512x1x1xf32>
    %c1_c = loom.conv2d %x, %c1_w : tensor<?x512x28x28xf32>, tensor<128x512x1x1xf32>
    %c1_g = loom.get @bn1.g : tensor<128xf32>
    %c1_b = loom.get @bn1.b : tensor<128xf32>
    %c1 = loom.batchnorm %c1_c, %c1_g, %c1_b : tensor<?x128x28x28xf32>, tensor<128xf32>, tensor<128xf32>
    %a1 = loom.relu %c1 : tensor<?x128x28x28xf32>
    %c2_w = loom.get @conv2.w : tensor<128x128x3x3xf32>
    %c2_c = loom.conv2d %a1, %c2_w {padding = 1} : tensor<?x128x28x28xf32>, tensor<128x128x3x3xf32>
    %c2_g = loom.get @bn2.g : tensor<128xf32>
    %c2_b = loom.get @bn2.b : tensor<128xf32>
    %c2 = loom.batchnorm %c2_c, %c2_g, %c2_b : tensor<?x128x28x28xf32>, tensor<128xf32>, tensor<128xf32>
    %a2 = loom.relu %c2 : tensor<?x128x28x28xf32>
    %c3_w = loom.get @conv3.w : tensor<512x128x1x1xf32>
    %c3_c = loom.conv2d %a2, %c3_w : tensor<?x128x28x28xf32>, tensor<512x128x1x1xf32>
    %c3_g = loom.get @bn3.g : tensor<512xf32>
    %c3_b = loom.get @bn3.b : tensor<512xf32>
    %c3 = loom.batchnorm %c3_c, %c3_g, %c3_b : tensor<?x512x28x28xf32>, tensor<512xf32>, tensor<512xf32>
    %s = loom.add %c3, %x : tensor<?x512x28x28xf32>, tensor<?x512x28x28xf32>
    %y = loom.relu %s : tensor<?x512x28x28xf32>
    loom.yield %y : tensor<?x512x28x28xf32>
  }

  loom.block @stage3_first(%x: tensor<?x512x28x28xf32>) -> tensor<?x1024x14x14xf32> {
    loom.param @conv1.w : tensor<256x512x1x1xf32> init <normal(0.0625)>
    loom.param @bn1.g : tensor<256xf32> init <ones>
    loom.param @bn1.b : tensor<256xf32> init <zeros>
    loom.param @conv2.w : tensor<256x256x3x3xf32> init <normal(0.0294628)>
    loom.param @bn2.g : tensor<256xf32> init <ones>
    loom.param @bn2.b : tensor<256xf32> init <zeros>
    loom.param @conv3.w : tensor<1024x256x1x1xf32> init <normal(0.0883883)>
    loom.param @bn3.g : tensor<1024xf32> init <ones>
    loom.param @bn3.b : tensor<1024xf32> init <zeros>
    loom.param @down.w : tensor<1024x512x1x1xf32> init <normal(0.0625)>
    loom.param @down_bn.g : tensor<1024xf32> init <ones>
    loom.param @down_bn.b : tensor<1024xf32> init <zeros>
    %c1_w = loom.get @conv1.w : tensor<256x512x1x1xf32>
    %c1_c = loom.conv2d %x, %c1_w : tensor<?x512x28x28xf32>, tensor<256x512x1x1xf32>
    %c1_g = loom.get @bn1.g : tensor<256xf32>
    %c1_b = loom.get @bn1.b : tensor<256xf32>
    %c1 = loom.batchnorm %c1_c, %c1_g, %c1_b : tensor<?x256x28x28xf32>, tensor<256xf32>, tensor<256xf32>
    %a1 = loom.relu %c1 : tensor<?x256x28x28xf32>
    %c2_w = loom.get @conv2.w : tensor<256x256x3x3xf32>
    %c2_c = loom.conv2d %a1, %c2_w {padding = 1, stride = 2} : tensor<?x256x28x28xf32>, tensor<256x256x3x3xf32>
    %c2_g = loom.get @bn2.g : tensor<256xf32>
    %c2_b = loom.get @bn2.b : tensor<256xf32>
    %c2 = loom.batchnorm %c2_c, %c2_g, %c2_b : tensor<?x256x14x14xf32>, tensor<256xf32>, tensor<256xf32>
    %a2 = loom.relu %c2 : tensor<?x256x14x14xf32>
    %c3_w = loom.get @conv3.w : tensor<1024x256x1x1xf32>
    %c3_c = loom.conv2d %a2, %c3_w : tensor<?x256x14x14xf32>, tensor<1024x256x1x1xf32>
    %c3_g = loom.get @bn3.g : tensor<1024xf32>
    %c3_b = loom.get @bn3.b : tensor<1024xf32>
    %c3 = loom.batchnorm %c3_c, %c3_g, %c3_b : tensor<?x1024x14x14xf32>, tensor<1024xf32>, tensor<1024xf32>
    %sc_w = loom.get @down.w : tensor<1024x512x1x1xf32>
    %sc_c = loom.conv2d %x, %sc_w {stride = 2} : tensor<?x512x28x28xf32>, tensor<1024x512x1x1xf32>
    %sc_g = loom.get @down_bn.g : tensor<1024xf32>
    %sc_b = loom.get @down_bn.b : tensor<1024xf32>
    %sc = loom.batchnorm %sc_c, %sc_g, %sc_b : tensor<?x1024x14x14xf32>, tensor<1024xf32>, tensor<1024xf32>
    %s = loom.add %c3, %sc : tensor<?x1024x14x14xf32>, tensor<?x1024x14x14xf32>
    %y = loom.relu %s : tensor<?x1024x14x14xf32>
    loom.yield %y : tensor<?x1024x14x14xf32>
  }

  loom.block @stage3(%x: tensor<?x1024x14x14xf32>) -> tensor<?x1024x14x14xf32> {
    loom.param @conv1.w : tensor<256x1024x1x1xf32> init <normal(0.0441942)>
    loom.param @bn1.g : tensor<256xf32> init <ones>
    loom.param @bn1.b : tensor<256xf32> init <zeros>
    loom.param @conv2.w : tensor<256x256x3x3xf32> init <normal(0.0294628)>
    loom.param @bn2.g : tensor<256xf32> init <ones>
    loom.param @bn2.b : tensor<256xf32> init <zeros>
    loom.param @conv3.w : tensor<1024x256x1x1xf32> init <normal(0.0883883)>
    loom.param @bn3.g : tensor<1024xf32> init <ones>
    loom.param @bn3.b : tensor<1024xf32> init <zeros>
    %c1_w = loom.get @conv1.w : tensor<256x1024x1x1xf32>
    %c1_c = loom.conv2d %x, %c1_w : tensor<?x1024x14x14xf32>, tensor<256x1024x1x1xf32>
    %c1_g = loom.get @bn1.g : tensor<256xf32>
    %c1_b = loom.get @bn1.b : tensor<256xf32>
    %c1 = loom.batchnorm %c1_c, %c1_g, %c1_b : tensor<?x256x14x14xf32>, tensor<256xf32>, tensor<256xf32>
    %a1 = loom.relu %c1 : tensor<?x256x14x14xf32>
    %c2_w = loom.get @conv2.w : tensor<256x256x3x3xf32>
    %c2_c = loom.conv2d %a1, %c2_w {padding = 1} : tensor<?x256x14x14xf32>, tensor<256x256x3x3xf32>
    %c2_g = loom.get @bn2.g : tensor<256xf32>
    %c2_b = loom.get @bn2.b : tensor<256xf32>
    %c2 = loom.batchnorm %c2_c, %c2_g, %c2_b : tensor<?x256x14x14xf32>, tensor<256xf32>, tensor<256xf32>
    %a2 = loom.relu %c2 : tensor<?x256x14x14xf32>
    %c3_w = loom.get @conv3.w : tensor<1024x256x1x1xf32>
    %c3_c = loom.conv2d %a2, %c3_w : tensor<?x256x14x14xf32>, tensor<1024x256x1x1xf32>
    %c3_g = loom.get @bn3.g : tensor<1024xf32>
    %c3_b = loom.get @bn3.b : tensor<1024xf32>
    %c3 = loom.batchnorm %c3_c, %c3_g, %c3_b : tensor<?x1024x14x14xf32>, tensor<1024xf32>, tensor<1024xf32>
    %s = loom.add %c3, %x : tensor<?x1024x14x14xf32>, tensor<?x1024x14x14xf32>
    %y = loom.relu %s : tensor<?x1024x14x14xf32>
    loom.yield %y : tensor<?x1024x14x14xf32>
  }

  loom.block @stage4_first(%x: tensor<?x1024x14x14xf32>) -> tensor<?x2048x7x7xf32> {
    loom.param @conv1.w : tensor<512x1024x1x1xf32> init <normal(0.0441942)>
    loom.param @bn1.g : tensor<512xf32> init <ones>
    loom.param @bn1.b : tensor<512xf32> init <zeros>
    loom.param @conv2.w : tensor<512x512x3x3xf32> init <normal(0.0208333)>
    loom.param @bn2.g : tensor<512xf32> init <ones>
    loom.param @bn2.b : tensor<512xf32> init <zeros>
    loom.param @conv3.w : tensor<2048x512x1x1xf32> init <normal(0.0625)>
    loom.param @bn3.g : tensor<2048xf32> init <ones>
    loom.param @bn3.b : tensor<2048xf32> init <zeros>
    loom.param @down.w : tensor<2048x1024x1x1xf32> init <normal(0.0441942)>
    loom.param @down_bn.g : tensor<2048xf32> init <ones>
    loom.param @down_bn.b : tensor<2048xf32> init <zeros>
    %c1_w = loom.get @conv1.w : tensor<512x1024x1x1xf32>
    %c1_c = loom.conv2d %x, %c1_w : tensor<?x1024x14x14xf32>, tensor<512x1024x1x1xf32>
    %c1_g = loom.get @bn1.g : tensor<512xf32>
    %c1_b = loom.get @bn1.b : tensor<512xf32>
    %c1 = loom.batchnorm %c1_c, %c1_g, %c1_b : tensor<?x512x14x14xf32>, tensor<512xf32>, tensor<512xf32>
    %a1 = loom.relu %c1 : tensor<?x512x14x14xf32>
    %c2_w = loom.get @conv2.w : tensor<512x512x3x3xf32>
    %c2_c = loom.conv2d %a1, %c2_w {padding = 1, stride = 2} : tensor<?x512x14x14xf32>, tensor<512x512x3x3xf32>
    %c2_g = loom.get @bn2.g : tensor<512xf32>
    %c2_b = loom.get @bn2.b : tensor<512xf32>
    %c2 = loom.batchnorm %c2_c, %c2_g, %c2_b : tensor<?x512x7x7xf32>, tensor<512xf32>, tensor<512xf32>
    %a2 = loom.relu %c2 : tensor<?x512x7x7xf32>
    %c3_w = loom.get @conv3.w : tensor<2048x512x1x1xf32>
    %c3_c = loom.conv2d %a2, %c3_w : tensor<?x512x7x7xf32>, tensor<2048x512x1x1xf32>
    %c3_g = loom.get @bn3.g : tensor<2048xf32>
    %c3_b = loom.get @bn3.b : tensor<2048xf32>
    %c3 = loom.batchnorm %c3_c, %c3_g, %c3_b : tensor<?x2048x7x7xf32>, tensor<2048xf32>, tensor<2048xf32>
    %sc_w = loom.get @down.w : tensor<2048x1024x1x1xf32>
    %sc_c = loom.conv2d %x, %sc_w {stride = 2} : tensor<?x1024x14x14xf32>, tensor<2048x1024x1x1xf32>
    %sc_g = loom.get @down_bn.g : tensor<2048xf32>
    %sc_b = loom.get @down_bn.b : tensor<2048xf32>
    %sc = loom.batchnorm %sc_c, %sc_g, %sc_b : tensor<?x2048x7x7xf32>, tensor<2048xf32>, tensor<2048xf32>
    %s = loom.add %c3, %sc : tensor<?x2048x7x7xf32>, tensor<?x2048x7x7xf32>
    %y = loom.relu %s : tensor<?x2048x7x7xf32>
    loom.yield %y : tensor<?x2048x7x7xf32>
  }

  loom.block @stage4(%x: tensor<?x2048x7x7xf32>) -> tensor<?x2048x7x7xf32> {
    loom.param @conv1.w : tensor<512x2048x1x1xf32> init <normal(0.03125)>
    loom.param @bn1.g : tensor<512xf32> init <ones>
    loom.param @bn1.b : tensor<512xf32> init <zeros>
    loom.param @conv2.w : tensor<512x512x3x3xf32> init <normal(0.0208333)>
    loom.param @bn2.g : tensor<512xf32> init <ones>
    loom.param @bn2.b : tensor<512xf32> init <zeros>
    loom.param @conv3.w : tensor<2048x512x1x1xf32> init <normal(0.0625)>
    loom.param @bn3.g : tensor<2048xf32> init <ones>
    loom.param @bn3.b : tensor<2048xf32> init <zeros>
    %c1_w = loom.get @conv1.w : tensor<512x2048x1x1xf32>
    %c1_c = loom.conv2d %x, %c1_w : tensor<?x2048x7x7xf32>, tensor<512x2048x1x1xf32>
    %c1_g = loom.get @bn1.g : tensor<512xf32>
    %c1_b = loom.get @bn1.b : tensor<512xf32>
    %c1 = loom.batchnorm %c1_c, %c1_g, %c1_b : tensor<?x512x7x7xf32>, tensor<512xf32>, tensor<512xf32>
    %a1 = loom.relu %c1 : tensor<?x512x7x7xf32>
    %c2_w = loom.get @conv2.w : tensor<512x512x3x3xf32>
    %c2_c = loom.conv2d %a1, %c2_w {padding = 1} : tensor<?x512x7x7xf32>, tensor<512x512x3x3xf32>
    %c2_g = loom.get @bn2.g : tensor<512xf32>
    %c2_b = loom.get @bn2.b : tensor<512xf32>
    %c2 = loom.batchnorm %c2_c, %c2_g, %c2_b : tensor<?x512x7x7xf32>, tensor<512xf32>, tensor<512xf32>
    %a2 = loom.relu %c2 : tensor<?x512x7x7xf32>
    %c3_w = loom.get @conv3.w : tensor<2048x512x1x1xf32>
    %c3_c = loom.conv2d %a2, %c3_w : tensor<?x512x7x7xf32>, tensor<2048x512x1x1xf32>
    %c3_g = loom.get @bn3.g : tensor<2048xf32>
    %c3_b = loom.get @bn3.b : tensor<2048xf32>
    %c3 = loom.batchnorm %c3_c, %c3_g, %c3_b : tensor<?x2048x7x7xf32>, tensor<2048xf32>, tensor<2048xf32>
    %s = loom.add %c3, %x : tensor<?x2048x7x7xf32>, tensor<?x2048x7x7xf32>
    %y = loom.relu %s : tensor<?x2048x7x7xf32>
    loom.yield %y : tensor<?x2048x7x7xf32>
  }

  func.func @forward(%images: tensor<?x3x224x224xf32>) -> tensor<?x1000xf32> {
    %stem_w = loom.get @stem.w : tensor<64x3x7x7xf32>
    %s0 = loom.conv2d %images, %stem_w {padding = 3, stride = 2} : tensor<?x3x224x224xf32>, tensor<64x3x7x7xf32>
    %stem_g = loom.get @stem_bn.g : tensor<64xf32>
    %stem_b = loom.get @stem_bn.b : tensor<64xf32>
    %s1 = loom.batchnorm %s0, %stem_g, %stem_b : tensor<?x64x112x112xf32>, tensor<64xf32>, tensor<64xf32>
    %s2 = loom.relu %s1 : tensor<?x64x112x112xf32>
    %x0 = loom.max_pool2d %s2 {kernel = 3, padding = 1, stride = 2} : tensor<?x64x112x112xf32>
    %x1a = loom.repeat 1 @stage1_first(%x0) : (tensor<?x64x56x56xf32>) -> tensor<?x256x56x56xf32>
    %x1 = loom.repeat 2 @stage1(%x1a) : (tensor<?x256x56x56xf32>) -> tensor<?x256x56x56xf32>
    %x2a = loom.repeat 1 @stage2_first(%x1) : (tensor<?x256x56x56xf32>) -> tensor<?x512x28x28xf32>
    %x2 = loom.repeat 3 @stage2(%x2a) : (tensor<?x512x28x28xf32>) -> tensor<?x512x28x28xf32>
    %x3a = loom.repeat 1 @stage3_first(%x2) : (tensor<?x512x28x28xf32>) -> tensor<?x1024x14x14xf32>
    %x3 = loom.repeat 5 @stage3(%x3a) : (tensor<?x1024x14x14xf32>) -> tensor<?x1024x14x14xf32>
    %x4a = loom.repeat 1 @stage4_first(%x3) : (tensor<?x1024x14x14xf32>) -> tensor<?x2048x7x7xf32>
    %x4 = loom.repeat 2 @stage4(%x4a) : (tensor<?x2048x7x7xf32>) -> tensor<?x2048x7x7xf32>
    %pooled = loom.reduce_mean %x4 {axes = array<i64: 2, 3>} : tensor<?x2048x7x7xf32>
    %fc_w = loom.get @fc.w : tensor<2048x1000xf32>
    %fc_b = loom.get @fc.b : tensor<1000xf32>
    %l0 = loom.matmul %pooled, %fc_w : tensor<?x2048xf32>, tensor<2048x1000xf32>
    %logits = loom.add %l0, %fc_b : tensor<?x1000xf32>, tensor<1000xf32>
    return %logits : tensor<?x1000xf32>
  }

  func.func @loss(%images: tensor<?x3x224x224xf32>, %labels: tensor<?xi32>) -> tensor<f32> {
    %logits = call @forward(%images) : (tensor<?x3x224x224xf32>) -> tensor<?x1000xf32>
    %loss = loom.cross_entropy %logits, %labels : tensor<?x1000xf32>, tensor<?xi32>
    return %loss : tensor<f32>
  }
}
