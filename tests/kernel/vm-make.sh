# bcachefilter kernel test, VM side (busybox sh): the kernel makes the
# cache.  /dev/vda was made by make-bcache -C and never registered,
# /dev/vdb by make-bcache -B (detached).  Register both, attach, write
# /data/pat at the /data/kwrites ranges (writethrough), read them back
# (hits), read the /data/kreads ranges twice (a miss that caches the
# backing device's data, then a hit), and stop cleanly without detaching
# (a detach would drop the cached data).
#
# /data/params (sourced):
#   CSET=<the set uuid of /dev/vda>
#   WRITEBACK=1   (optional) the writes in cache_mode writeback with
#                 writeback_running 0: they stay dirty in the cache, and
#                 the stop leaves the device's superblock dirty
. /vm-lib.sh
. /data/params
S=/sys/fs/bcache
readmd5 () {            # readmd5 LIST: md5 of each range read through bcache0
  while read -r off len; do
    dd if=/dev/bcache0 bs=65536 skip=$off count=$len \
       iflag=skip_bytes,count_bytes,direct 2>/dev/null | md5sum | cut -d' ' -f1
  done < $1
}

echo /dev/vda > $S/register || echo "register vda: write failed"
if waitfor "[ -d $S/$CSET ]" 50; then echo "RESULT cset-appeared $CSET"
else echo "RESULT cset-missing $CSET"; exit 1; fi
echo 0 > $S/$CSET/congested_read_threshold_us
echo 0 > $S/$CSET/congested_write_threshold_us
echo /dev/vdb > $S/register || echo "register vdb: write failed"
waitfor '[ -e /sys/block/bcache0/bcache/state ]' 100 ||
  { echo "RESULT no-bcache0"; exit 1; }
B=/sys/block/bcache0/bcache
echo $CSET > $B/attach || echo "attach: write failed"
if waitfor '[ -e $B/cache ]' 100; then echo "RESULT attached $(cat $B/state)"
else echo "RESULT not-attached $(cat $B/state)"; exit 1; fi
echo 0 > $B/sequential_cutoff
if [ "$WRITEBACK" = 1 ]; then
  echo 0 > $B/writeback_running
  echo writeback > $B/cache_mode
else
  echo writethrough > $B/cache_mode
fi
echo "RESULT cache-mode $(sed 's/.*\[\(.*\)\].*/\1/' $B/cache_mode)"

write_ranges /data/pat /data/kwrites
echo "RESULT kwrites-mismatches $(ranges_mismatching /data/pat /data/kwrites)"
readmd5 /data/kreads > /tmp/kreads.1
readmd5 /data/kreads > /tmp/kreads.2
cmp -s /tmp/kreads.1 /tmp/kreads.2 && echo "RESULT kreads-stable" ||
  echo "RESULT kreads-unstable"
echo "KREADS-BEGIN"; cat /tmp/kreads.1; echo "KREADS-END"
echo "  tree_depth $(cat $S/$CSET/tree_depth), btree nodes" \
     "$(cat $S/$CSET/internal/btree_nodes)"
echo "RESULT state $(cat $B/state)"
echo "RESULT dirty-data $(cat $B/dirty_data)"

echo 1 > $B/stop
waitfor '[ ! -e /sys/block/bcache0 ]' 300 || echo "  bcache0 did not stop"
echo 1 > $S/$CSET/stop
if waitfor "[ ! -d $S/$CSET ]" 600; then echo "RESULT stopped-cleanly"
else echo "RESULT stop-timeout"; fi
sync
