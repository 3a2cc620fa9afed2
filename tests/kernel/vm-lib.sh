# bcachefilter kernel test, VM side: helpers the VM scripts share (busybox
# sh; kernel.sh's vm_boot puts this file at /vm-lib.sh).

# waitfor TEST TENTHS: wait until the shell test TEST holds, polling every
# 0.1 s, at most TENTHS times; false if it never did.
waitfor () {
  n=0
  while [ $n -lt $2 ]; do eval "$1" && return 0; usleep 100000; n=$((n + 1)); done
  return 1
}

# write_ranges PAT LIST: write the bytes of PAT, back to back, at the
# "OFFSET LENGTH" lines of LIST on /dev/bcache0 (O_DIRECT), then sync.
write_ranges () {
  po=0
  while read -r off len; do
    dd if=$1 of=/dev/bcache0 bs=65536 skip=$po seek=$off count=$len \
       iflag=skip_bytes,count_bytes oflag=seek_bytes,direct conv=notrunc \
       2>/dev/null || echo "  write at $off failed"
    po=$((po + len))
  done < $2
  sync
}

# ranges_mismatching PAT LIST: how many of those ranges read back from
# /dev/bcache0 (O_DIRECT) differ from what write_ranges wrote.
ranges_mismatching () {
  po=0 bad=0
  while read -r off len; do
    a=$(dd if=/dev/bcache0 bs=65536 skip=$off count=$len \
           iflag=skip_bytes,count_bytes,direct 2>/dev/null | md5sum)
    b=$(dd if=$1 bs=65536 skip=$po count=$len \
           iflag=skip_bytes,count_bytes 2>/dev/null | md5sum)
    [ "$a" = "$b" ] || bad=$((bad + 1))
    po=$((po + len))
  done < $2
  echo $bad
}
