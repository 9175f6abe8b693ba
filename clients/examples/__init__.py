"""The example trainers, run from the repository root as modules:

    python -m clients.examples.dlrm              # also digits_convnet, lstm_lm, serving
    torchrun --nproc-per-node 2 -m clients.examples.dlrm --cluster-file shardps-cluster.json
"""
