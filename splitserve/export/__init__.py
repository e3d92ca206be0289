"""`splitserve export`: the batchful part as an ONNX graph with the batchless cut as one
`ai.splitserve::BatchlessAttention` node per layer (attention_graph.py builds the op's plain-ONNX
definition, exporter.py the files). The exported directory is served by worker/onnx_runner.py."""
