#!/bin/bash
cp /srv/service/greeting greeting.txt
