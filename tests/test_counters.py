from directkv.counters import aggregate, parse_csv

CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","split_kernel","1","7","(128, 1, 1)","(264, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","3,000,000"
"0","1","python3","h","split_kernel","1","7","(128, 1, 1)","(264, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","10"
"0","1","python3","h","split_kernel","1","7","(128, 1, 1)","(264, 1, 1)","0","9.0","Command line profiler metrics","pcie__read_bytes.sum","byte","268435456"
"1","1","python3","h","merge_kernel","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","1000"
"1","1","python3","h","merge_kernel","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","90"
"1","1","python3","h","merge_kernel","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","pcie__read_bytes.sum","Kbyte","4"
"1","1","python3","h","merge_kernel","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Mbyte","2"
"0","1","python3","h","split_kernel","1","7","(128, 1, 1)","(264, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","5"
'''


def test_parse_and_aggregate_ncu_csv():
    rows = parse_csv(CSV)
    assert len(rows) == 8
    agg = aggregate(rows)
    assert agg["ncu_dram_write_bytes"] == 2e6 + 5
    assert agg["ncu_kernels"] == 2
    assert agg["ncu_pcie_read_bytes"] == 268435456 + 4000
    assert agg["ncu_time_ms"] == 4.0
    assert agg["l2_hit_pct"] == (10 * 3e6 + 90 * 1e6) / 4e6  # weighted by kernel time


def test_no_kernels_is_not_an_error_in_parsing():
    assert parse_csv("==PROF== nothing\n") == []
    assert aggregate([]) == {"ncu_kernels": 0.0}
