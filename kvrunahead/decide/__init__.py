"""What the runtime decides with: the partition and degree policy, and the partition tables it reads."""
