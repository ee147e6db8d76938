"""Ad hoc (not kept): does Inductor freezing fuse Q/K/V of the exported HF BERT on the GPU, as on the CPU?"""
import re, torch, torch._inductor.config as ic
from torch._inductor.utils import run_and_get_code
from torch._dynamo.utils import counters
from transformers import BertConfig, BertModel
torch.manual_seed(0)
class M(torch.nn.Module):
    def __init__(s):
        super().__init__(); s.b=BertModel(BertConfig(num_hidden_layers=2)); s.h=torch.nn.Linear(768,2)
    def forward(s,ids,mask): return s.h(s.b(input_ids=ids,attention_mask=mask).pooler_output)
m=M().eval().half().cuda()
ids=torch.randint(0,1000,(2,128),device="cuda"); mask=torch.ones(2,128,dtype=torch.long,device="cuda")
B=torch.export.Dim("batch",min=1,max=32)
mod=torch.export.export(m,(ids,mask),dynamic_shapes=({0:B},{0:B})).module()
for frz in (False,True):
    torch.compiler.reset(); counters.clear()
    with torch.inference_mode():
        out, code = run_and_get_code(torch.compile(mod, options={"freezing": frz}, dynamic=False), ids, mask)
    c="\n".join(code)
    print("freezing", frz, "grad", torch.is_grad_enabled(), "mm calls", len(re.findall(r"extern_kernels\.(?:addmm|mm|bmm)\(", c)),
          "frozen consts", len(set(re.findall(r"_frozen_param\d+", c))), dict(counters["inductor"]))
