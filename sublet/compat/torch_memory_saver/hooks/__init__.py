"""torch_memory_saver.hooks on sublet: the original's hook modes ("preload": an LD_PRELOADed
cudaMalloc; "torch": a pluggable allocator), as Python-level stand-ins. sublet needs neither to
route a region's allocations (its pools do, in both modes); what they do not do is in each
module."""
