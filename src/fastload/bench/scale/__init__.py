"""The ImageNet-scale benchmark (``fastload bench --scale``): 1.28 M objects, 1,024 shards."""
